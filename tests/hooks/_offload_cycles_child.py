"""offload -> forward -> handle.close() -> daemon.close() cycles (a child of test_offload_cycles.py).

argv: store_dir cycles [address_space_slack_bytes] [readme|dropped]
"readme": the README's usage instead, `with Daemon(...) as daemon:` and no handle.close().
"dropped": a started Daemon and the model dropped with neither closed (the daemon's
finalizer closes it, with a WARNING).
With a slack, RLIMIT_AS is set after the first cycle to the address space in use then plus
the slack: a cycle that keeps its daemon's reservation (64 GiB of homes) soon fails.
Prints one JSON line per cycle: {"cycle", "alive": [model, handle, daemon], "vm_kib",
"maps", "threads"}, or {"cycle", "error"} and exits 1.
"""
import gc
import json
import os
import resource
import sys
import threading
import weakref

import mindspore as ms
import numpy as np

import prefetchd

store_dir, cycles = sys.argv[1], int(sys.argv[2])
slack = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] != "-" else None
usage = sys.argv[4] if len(sys.argv) > 4 else "closed"
ms.set_device("CPU")
D = 64
x = ms.Tensor(np.random.default_rng(3).standard_normal((2, D)).astype(np.float32))


def vm_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))


def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def cycle(i):
    nn = ms.nn
    ms.set_seed(i)
    model = nn.SequentialCell([nn.SequentialCell([nn.Dense(D, D), nn.ReLU()]) for _ in range(6)])
    model.set_train(False)
    want = model(x).asnumpy()
    daemon = prefetchd.Daemon(device_budget=int(sum(p.nbytes for p in model.get_parameters()) * 0.6),
                              store_dir=os.path.join(store_dir, str(i)), name=f"cycle{i}")
    if usage == "dropped":
        handle = prefetchd.offload(model, daemon.start(), lookahead=1)
        for _ in range(2):
            np.testing.assert_array_equal(model(x).asnumpy(), want)
        return [weakref.ref(model), weakref.ref(handle), weakref.ref(daemon)]
    with daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        for _ in range(2):
            np.testing.assert_array_equal(model(x).asnumpy(), want)
        if usage == "closed":
            handle.close()
    return [weakref.ref(model), weakref.ref(handle), weakref.ref(daemon)]


for i in range(cycles):
    try:
        refs = cycle(i)
    except Exception as e:   # noqa: BLE001 - reported to the test
        print(json.dumps({"cycle": i, "error": f"{type(e).__name__}: {e}"}), flush=True)
        sys.exit(1)
    gc.collect()
    gc.collect()     # a dropped daemon's finalizer ran in the first; its stopped thread left more
    print(json.dumps({"cycle": i, "alive": [r() is not None for r in refs], "vm_kib": vm_kib(),
                      "maps": maps(), "threads": threading.active_count()}), flush=True)
    if i == 0 and slack is not None:
        limit = vm_kib() * 1024 + slack
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
