"""`prefetchd bench model`: a model larger than its device budget, four ways, one run.

Same model (a stack of Dense(hidden, hidden) layers, fp32), same inputs:
  (a) resident     weights in framework memory, no prefetchd
  (b) on-demand    streamed through prefetchd with lookahead 0: each layer is
                   loaded synchronously when it runs (Accelerate's offload hooks)
  (c) prefetchd    streamed with lookahead k
  (d) io-only      the same bytes read through the file store (remote tier) or
                   copied from the host tier, no compute
for the remote tier (weights on disk) and the host tier (weights in RAM), at
each batch size. Reports (c)/max(a,d) and (b)/(c), and peak device bytes
against the high watermark. Outputs of (b) and (c) are checked against (a).
"""
import os
import shutil
import statistics
import time

import numpy as np

from .sched import _drop_caches

MiB = 1 << 20


def _build(ms, hidden, layers, seed=0):
    from mindspore.nn.utils import no_init_parameters
    with no_init_parameters():
        model = ms.nn.SequentialCell([ms.nn.Dense(hidden, hidden) for _ in range(layers)])
    rng = np.random.default_rng(seed)
    for p in model.get_parameters():
        shape = tuple(p.shape)
        scale = 1.0 / np.sqrt(hidden) if len(shape) == 2 else 0.01
        p.set_data(ms.Tensor.from_numpy((rng.standard_normal(shape, dtype=np.float32) * scale)))
    return model


def _time_passes(fn, passes):
    times, out = [], None
    for _ in range(passes):
        _drop_caches()
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), times, out


def _streamed(ms, Daemon, offload, hidden, layers, tier, budget, lookahead, x, passes, store_dir):
    from .. import _native  # noqa: F401  (fail early if the engine is missing)
    model = _build(ms, hidden, layers)
    daemon = Daemon(device_budget=budget, store_dir=store_dir, name=f"bench-{tier}-{lookahead}").start()
    try:
        offload(model, daemon, lookahead=lookahead, tier=tier, auto_fetch=True)
        model(x).asnumpy()                      # records the trace
        median, times, out = _time_passes(lambda: model(x).asnumpy(), passes)
        status, stats = daemon.snapshot()
        return median, times, out, {
            "peak_device_bytes": status["device"]["peak"],
            "high_watermark": status["device"]["high_watermark"],
            "stall_seconds": stats.stall.sum, "fences": stats.fences,
            "loaded_bytes": stats.transfer_bytes["load"] + stats.transfer_bytes["h2d"],
        }
    finally:
        daemon.close()


def _io_only(ms, Daemon, hidden, layers, tier, budget, passes, store_dir):
    """The weight bytes moved through the same tier and engine, nothing computed:
    the file store's checksummed read (remote) or the copy stream (host) into a
    device-sized buffer, one tensor after another."""
    from .. import _native
    model = _build(ms, hidden, layers)
    daemon = Daemon(device_budget=budget, store_dir=store_dir, name=f"bench-io-{tier}").start()
    try:
        recs = [daemon.register(p, p.name, tier=tier)._rec for p in model.get_parameters()]
        backend = daemon.backend
        dst = _native.aligned_buffer(max(r.nbytes for r in recs))

        def one_pass():
            for rec in recs:
                if tier == "remote":
                    backend.store.read_sync(rec.name, dst, True)
                else:
                    backend.load_stream.copy(dst, rec.host_block, rec.nbytes).synchronize()
        median, times, _ = _time_passes(one_pass, passes)
        return median, times
    finally:
        daemon.close()


def run(directory, args):
    from ..backend.framework import mindspore
    from ..config import parse_size
    from ..daemon import Daemon
    from ..hooks import offload
    ms = mindspore()
    ms.set_device("CPU")
    hidden = args.hidden
    layer_bytes = (hidden * hidden + hidden) * 4
    layers = args.layers or max(4, round(parse_size(args.size, "--size") / layer_bytes))
    model_bytes = layers * layer_bytes
    budget = int(model_bytes * args.budget)
    batches = args.batch or [1, 8, 64]
    passes = max(2, args.repeats)
    results = []
    for tier in ("remote", "host"):
        for batch in batches:
            store_dir = os.path.join(directory, f"{tier}-{batch}")
            x = ms.Tensor.from_numpy(np.random.default_rng(batch).standard_normal((batch, hidden), dtype=np.float32))
            resident_model = _build(ms, hidden, layers)
            resident_model(x).asnumpy()
            resident, resident_times, want = _time_passes(lambda: resident_model(x).asnumpy(), passes)
            del resident_model
            io, io_times = _io_only(ms, Daemon, hidden, layers, tier, budget, passes, store_dir + "-io")
            demand, _, out_b, info_b = _streamed(ms, Daemon, offload, hidden, layers, tier, budget, 0, x,
                                                  passes, store_dir + "-b")
            pre, pre_times, out_c, info_c = _streamed(ms, Daemon, offload, hidden, layers, tier, budget,
                                                      args.lookahead, x, passes, store_dir + "-c")
            for d in (store_dir + "-io", store_dir + "-b", store_dir + "-c"):
                shutil.rmtree(d, ignore_errors=True)
            bound = max(resident, io)
            results.append({
                "tier": tier, "batch": batch,
                "seconds": {"resident": resident, "on_demand": demand, "prefetchd": pre, "io_only": io},
                "prefetchd_over_bound": pre / bound,
                "bound": "compute" if resident >= io else "io",
                "speedup_over_on_demand": demand / pre,
                "outputs_match": bool(np.array_equal(out_b, want) and np.array_equal(out_c, want)),
                "prefetchd": info_c, "on_demand": info_b,
                "watermark_respected": info_c["peak_device_bytes"] <= info_c["high_watermark"]
                and info_b["peak_device_bytes"] <= info_b["high_watermark"],
            })
    ok = all(r["outputs_match"] and r["watermark_respected"] for r in results)
    return {"benchmark": "model", "hidden": hidden, "layers": layers, "model_bytes": model_bytes,
            "device_budget": budget, "lookahead": args.lookahead, "passes": passes,
            "results": results, "ok": ok}
