"""A daemon under load with a metrics exporter, for tests that scrape it from outside.

    python tests/_load_daemon.py --store-dir DIR [--port 0] [--seconds 120] [--name load]

Streams the demo transformer (prefetchd.demo.model) through a Daemon with
`prefetchd.offload` -- the real layer hooks: trace, lookahead prefetches, pins,
stall accounting -- on a device budget smaller than the model, so every forward
pass loads from the remote tier and evicts at the watermark. Now and then a
weight is marked dirty and flushed (store traffic) and a unit is run out of
order (a trace re-sync).

Prints one JSON line {"port": <bound metrics port>, "pid": <pid>} on stdout once
the exporter is up, then runs until --seconds pass, SIGTERM/SIGINT arrives,
stdin closes or the parent dies, and closes the daemon cleanly.
"""
import argparse
import json
import os
import signal
import sys
import threading
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store-dir", required=True)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--addr", default="127.0.0.1")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--name", default="load")
    ap.add_argument("--hidden", type=int, default=128)     # 768 KiB of fp32 weights per layer
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--budget", default="3MiB")
    ap.add_argument("--lookahead", type=int, default=2)
    ap.add_argument("--pause", type=float, default=0.005, help="seconds between forward passes")
    args = ap.parse_args(argv)

    import mindspore as ms
    import numpy as np
    import prefetchd
    from prefetchd.demo.model import build_model, make_inputs

    ms.set_device("CPU")
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
        model = build_model(hidden=args.hidden, layers=args.layers)
        # auto_fetch: the out-of-order unit below is fetched on demand (a counted miss).
        handle = prefetchd.offload(model, daemon, lookahead=args.lookahead, auto_fetch=True)
        x = make_inputs(batch=2, seq=8, hidden=args.hidden)
        hidden_states = ms.Tensor(np.random.default_rng(0).standard_normal((2, 8, args.hidden), dtype=np.float32))
        model(x)                                    # the first pass records the trace
        print(json.dumps({"port": daemon.metrics_port, "pid": os.getpid()}), flush=True)

        names = daemon.names()
        deadline = time.monotonic() + args.seconds
        step = 0
        while not stop.is_set() and time.monotonic() < deadline and os.getppid() == parent:
            model(x)
            step += 1
            if step % 5 == 0:                      # a block out of trace order: re-sync
                model.blocks[step % len(model.blocks)](hidden_states)
            if step % 7 == 0:                      # a weight updated in place: write-back
                name = names[step % len(names)]
                daemon.mark_dirty(name)
                daemon.flush(name).result(timeout=30)
            time.sleep(args.pause)                 # keep a shared machine usable
        handle.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
