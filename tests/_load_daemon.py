"""A daemon under load with a metrics exporter, for tests that scrape it from outside.

    python tests/_load_daemon.py --store-dir DIR [--port 0] [--seconds 120] [--name load]

Prints one JSON line {"port": <bound metrics port>, "pid": <pid>} on stdout once
the exporter is up, then loops like a model running layer by layer until
--seconds pass, SIGTERM/SIGINT arrives, stdin closes or the parent dies, and
closes the daemon cleanly. The device budget is a fraction of the working set,
so every pass loads from the remote tier and evicts at the watermark.
"""
import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store-dir", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--addr", default="127.0.0.1")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--name", default="load")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--layer-bytes", type=int, default=256 << 10)
    ap.add_argument("--budget", type=int, default=1 << 20)
    ap.add_argument("--lookahead", type=int, default=2)
    args = ap.parse_args(argv)

    import mindspore as ms
    import prefetchd

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    parent = os.getppid()

    def watch_stdin():  # the test closes our stdin (or dies): stop
        try:
            sys.stdin.read()
        finally:
            stop.set()
    threading.Thread(target=watch_stdin, daemon=True).start()

    daemon = prefetchd.Daemon(device_budget=args.budget, store_dir=args.store_dir, name=args.name,
                              metrics_port=args.port, metrics_addr=args.addr)
    with daemon:
        n = args.layer_bytes // 4
        names = []
        for i in range(args.layers):
            t = ms.Tensor(np.full((n,), float(i), dtype=np.float32))
            names.append(daemon.register(t, name=f"layer{i}.weight", tier="remote").name)
        print(json.dumps({"port": daemon.metrics_port, "pid": os.getpid()}), flush=True)

        deadline = time.monotonic() + args.seconds
        step = 0
        while not stop.is_set() and time.monotonic() < deadline and os.getppid() == parent:
            for i, name in enumerate(names):
                if stop.is_set():
                    break
                ahead = [names[(i + k) % len(names)] for k in range(1, args.lookahead + 1)]
                daemon.prefetch(ahead)
                with daemon.use(name):
                    pass  # "compute": the tensor is resident and pinned here
                step += 1
                if step % 7 == 0:
                    daemon.mark_dirty(name)
                    daemon.flush(name).result(timeout=30)
                if step % 11 == 0:
                    try:
                        daemon.evict(names[(i + 3) % len(names)]).result(timeout=30)
                    except prefetchd.PinnedError:
                        pass
            time.sleep(0.01)  # keep a shared 2-core machine usable
    return 0


if __name__ == "__main__":
    sys.exit(main())
