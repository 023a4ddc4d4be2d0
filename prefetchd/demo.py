"""`prefetchd demo`: stream a transformer larger than its device budget and check it.

1. Describe the model without allocating its weights, and stage each weight
   (deterministic values) into a store, one tensor at a time.
2. Run the fully resident model for reference outputs and timing.
3. Build it again without weights, offload it onto a daemon whose device
   budget is a fraction of the model, run the same passes.
4. Compare outputs bit for bit; print time per pass, stall time, hit rate,
   bytes moved, bandwidth and peak device bytes against the watermark.

Exits 1 if any output differs from the resident model's.
"""
import json
import shutil
import sys
import tempfile
import time

import numpy as np

from .staging import stage_tensors, tensor_meta, write_index


def _mib(n):
    return f"{n / 2**20:,.1f} MiB"


def run_demo(args):
    from . import _native, offload
    from .backend.framework import mindspore
    from .daemon import Daemon
    from .model import build_model, estimate_bytes, init_values, layers_for, make_inputs

    ms = mindspore()
    ms.set_device("CPU")
    hidden = args.hidden
    layers = layers_for(args.size, hidden)
    model_bytes = estimate_bytes(hidden, layers)
    budget = max(int(model_bytes * args.budget), 1 << 20)
    say = (lambda *a: None) if args.json else print
    say(f"prefetchd demo: {layers} transformer blocks, hidden {hidden}, {_mib(model_bytes)} of fp32 weights; "
        f"device budget {_mib(budget)} ({args.budget:.0%}); weights on the {args.tier} tier")

    own_store = args.store is None
    store_dir = args.store or tempfile.mkdtemp(prefix="prefetchd-demo-")
    try:
        # 1. stage: one tensor in RAM at a time
        t0 = time.perf_counter()
        skeleton = build_model(hidden, layers, materialize=False)
        store = _native.FileStore(store_dir)
        index = stage_tensors(store, ((p.name, tuple(p.shape), np.dtype(np.float32),
                                       init_values(p.name, tuple(p.shape)))
                                      for p in skeleton.get_parameters()))
        engine = store.engine
        store.close()
        write_index(store_dir, index)
        stage_s = time.perf_counter() - t0
        say(f"staged {len(index)} tensors into {store_dir} in {stage_s:.1f}s (I/O engine: {engine})")

        x = make_inputs(args.batch, args.seq, hidden)

        # 2. reference: fully resident
        reference = build_model(hidden, layers)
        want, resident_times = [], []
        for _ in range(args.passes):
            t = time.perf_counter()
            want.append(reference(x).asnumpy())
            resident_times.append(time.perf_counter() - t)
        del reference
        say(f"resident:  {np.median(resident_times):.3f}s per pass")

        # 3. offloaded
        model = build_model(hidden, layers, materialize=False)
        daemon = Daemon(device_budget=budget, store_dir=store_dir, lookahead=args.lookahead,
                        metrics_port=args.metrics_port, name="demo").start()
        try:
            if daemon.metrics_port:
                say(f"metrics: http://127.0.0.1:{daemon.metrics_port}/metrics")
            # auto_fetch: at budgets below two blocks nothing can be prefetched, and
            # the demo should still run (the misses are reported).
            offload(model, daemon, lookahead=args.lookahead, checkpoint=True, auto_fetch=True)
            if args.tier == "host":
                daemon.stage_to_host(daemon.names()).result()
            got, times = [], []
            for _ in range(args.passes):
                t = time.perf_counter()
                got.append(model(x).asnumpy())
                times.append(time.perf_counter() - t)
            status, stats = daemon.snapshot()
            if args.hold:
                say(f"holding {args.hold:.0f}s for metrics scrapes")
                time.sleep(args.hold)
        finally:
            daemon.close()
    finally:
        if own_store:
            shutil.rmtree(store_dir, ignore_errors=True)

    # 4. report
    mismatches = [i for i, (a, b) in enumerate(zip(want, got)) if not np.array_equal(a, b)]
    moved = stats.transfer_bytes["load"] + stats.transfer_bytes["h2d"]
    moved_s = stats.transfer_seconds["load"] + stats.transfer_seconds["h2d"]
    hits = stats.requests["fetch", "hit"]          # a unit's tensors were resident when it ran
    misses = stats.requests["fetch", "miss"]       # it had to wait for (or fetch) them
    report = {
        "model_bytes": model_bytes, "layers": layers, "hidden": hidden, "batch": args.batch,
        "device_budget": budget, "high_watermark": status["device"]["high_watermark"],
        "peak_device_bytes": status["device"]["peak"],
        "watermark_respected": status["device"]["peak"] <= status["device"]["high_watermark"],
        "tier": args.tier, "lookahead": args.lookahead, "io_engine": status["io_engine"],
        "resident_seconds_per_pass": float(np.median(resident_times)),
        "offloaded_seconds_per_pass": float(np.median(times[1:] if len(times) > 1 else times)),
        "first_pass_seconds": times[0],
        "stall_seconds": stats.stall.sum, "hit_rate": hits / max(1, hits + misses),
        "bytes_moved": moved, "bandwidth_MBps": moved / max(moved_s, 1e-9) / 1e6,
        "evictions": sum(stats.evictions.values()), "fences": stats.fences,
        "outputs_match": not mismatches, "passes": args.passes,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        r = report
        print(f"offloaded: {r['offloaded_seconds_per_pass']:.3f}s per pass "
              f"(first pass {r['first_pass_seconds']:.3f}s records the trace); "
              f"{r['offloaded_seconds_per_pass'] / r['resident_seconds_per_pass']:.2f}x resident")
        print(f"stall {r['stall_seconds']:.3f}s total, hit rate {r['hit_rate']:.1%}, "
              f"moved {_mib(r['bytes_moved'])} at {r['bandwidth_MBps']:,.0f} MB/s, "
              f"{r['evictions']} evictions, {r['fences']} compute fences")
        print(f"peak device {_mib(r['peak_device_bytes'])} vs high watermark {_mib(r['high_watermark'])}: "
              f"{'respected' if r['watermark_respected'] else 'EXCEEDED'}")
        print("outputs: identical to the resident model" if not mismatches else
              f"outputs: DIFFER from the resident model in pass(es) {mismatches}")
    return 0 if not mismatches and report["watermark_respected"] else 1

