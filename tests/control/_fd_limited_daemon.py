"""A served Daemon under a low RLIMIT_NOFILE (a child of test_connection_limits.py).

argv: endpoint store_dir soft [hard [curve_keys_dir]] (the RLIMIT_NOFILE; hard defaults to the
inherited one, 0 meaning the same; with a curve_keys_dir the endpoint requires CURVE).
Prints "ready <endpoint>" once serving; then reads
commands from stdin, one per line:
  check   registers, prefetches, evicts and flushes a new tensor (store reads and
          writes at the fd limit); prints "ok <n>" or "error <message>"
  fds     prints "fds <open descriptors> <connections held> <soft limit now>"
  pauses  prints "pauses <times the server stopped listening>"
  hog N   opens /dev/null until N descriptors are open (as an application sharing the
          process may); prints "hogging <open descriptors>"
  unhog   closes them; prints "unhogged <open descriptors>"
  quit    closes the daemon and exits 0
"""
import os
import resource
import sys

endpoint, store_dir, soft = sys.argv[1], sys.argv[2], int(sys.argv[3])
hard = int(sys.argv[4]) if len(sys.argv) > 4 and int(sys.argv[4]) else resource.getrlimit(resource.RLIMIT_NOFILE)[1]
curve_keys_dir = sys.argv[5] if len(sys.argv) > 5 else None
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

import mindspore as ms   # noqa: E402
import numpy as np       # noqa: E402

import prefetchd         # noqa: E402

ms.set_device("CPU")
daemon = prefetchd.Daemon(store_dir=store_dir, device_budget="16MiB", name="fdlimit").start()
server = daemon.serve(endpoint, curve_keys_dir=curve_keys_dir)
print("ready", server.endpoint, flush=True)
checks = 0
hogged = []
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "check":
        try:
            h = daemon.register(ms.Tensor(np.full(4096, checks, np.float32)), name=f"c{checks}",
                                tier="remote")
            daemon.prefetch(h).result(10)
            daemon.mark_dirty(h)
            daemon.flush(h).result(10)
            daemon.evict(h).result(10)
            daemon.prefetch(h).result(10)
            checks += 1
            print("ok", checks, flush=True)
        except Exception as e:   # noqa: BLE001 - reported to the test
            print("error", repr(e).replace("\n", " "), flush=True)
    elif cmd == "fds":
        print("fds", len(os.listdir("/proc/self/fd")), server.connections.counts()["connections"],
              resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
    elif cmd == "pauses":
        print("pauses", server.connections.guard.pauses, flush=True)
    elif cmd.startswith("hog "):
        while len(os.listdir("/proc/self/fd")) < int(cmd.split()[1]):
            hogged.append(os.open(os.devnull, os.O_RDONLY))
        print("hogging", len(os.listdir("/proc/self/fd")), flush=True)
    elif cmd == "unhog":
        while hogged:
            os.close(hogged.pop())
        print("unhogged", len(os.listdir("/proc/self/fd")), flush=True)
    elif cmd == "quit":
        break
daemon.close(10)
print("closed", flush=True)
