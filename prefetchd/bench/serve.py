"""`prefetchd bench serve`: what offloading and batching do to a served model.

One run starts, side by side, fronts serving the same model (same factory, same
seed, so the same weights) and interleaves their phases, so every ratio compares
phases measured minutes apart at most on this shared, noisy machine:

    resident    1 worker whose device budget holds the whole model (1.25x)
    offloaded   1 worker with --budget of the model (default 25%): every pass
                streams the weights
    generate    1 worker serving a causal LM (prefetchd.serve.tiny_lm) at --budget
    hints       --workers workers, 3 weight sets, a budget of 1.5 of them: requests
                switch models, with and without prefetch hints (kept from before)
    shared_host after the fronts above are closed: 4 workers (--quick: 2) with one
                host tier shared by the front against 4 with private host
                tiers, on one staged checkpoint (prefetchd.bench.serve_shared)

Each infer/generate front is measured with batching on (max_batch_size 32) and
off (max_batch_size 1; Front.max_batch_size is switched between phases, with
nothing queued), by closed-loop clients (prefetchd.bench.serve_load) at
concurrency 1, 8 and 32 (--quick: 1, 2, 4). Each phase reports requests/s, p50/p99 latency, the
mean batch size the front formed and, for generation, tokens/s; a phase is
complete when every request got a whole reply (prefetchd.bench.serve_load).

`--quick` is a tiny size for tests (correctness of the report, not speed).
`--only shared` (a hidden flag) runs the shared_host section alone.
"""
import os
import sys
import time

import numpy as np

from .serve_load import run_load
from .serve_phases import close_all, median, progress, ratio, start_all, summarize

CONCURRENCY = (1, 8, 32)
QUICK_CONCURRENCY = (1, 2, 4)      # --quick: a test's minute cannot hold 32 unbatched passes
MAX_BATCH = 32
INFER_MODES = ("resident_batched", "resident_unbatched", "offloaded_batched",
               "offloaded_unbatched")
GENERATE_MODES = ("offloaded_batched", "offloaded_unbatched")
TARGETS = {"offloaded_over_resident_batched": 0.8, "batched_over_unbatched_offloaded": 8.0}

# The language models `generate` phases serve: tiny_lm at a size whose 25% budget
# still holds lookahead + 2 of its blocks.
LM_FULL = dict(vocab=256, hidden=128, layers=8, heads=4, max_len=128)
LM_QUICK = dict(vocab=64, hidden=32, layers=8, heads=2, max_len=64)


def lm_full(seed=0):
    """`--model` factory of the full run's causal LM."""
    from ..serve.tiny_lm import build
    return build(seed=seed, **LM_FULL)


def lm_quick(seed=0):
    """`--model` factory of the --quick run's causal LM."""
    from ..serve.tiny_lm import build
    return build(seed=seed, **LM_QUICK)


def _lm_bytes(size):
    h, v, n = size["hidden"], size["vocab"], size["layers"]
    block = 3 * h * h + 3 * h + h * h + h + 4 * h * h + 4 * h + 4 * h * h + h + 4 * h
    return 4 * (n * block + v * h + size["max_len"] * h + 2 * h + h * v)


def _sizes(args):
    quick = bool(getattr(args, "quick", False))
    return {"quick": quick,
            "concurrency": QUICK_CONCURRENCY if quick else CONCURRENCY,
            "hidden": getattr(args, "hidden", None) or (32 if quick else 256),
            "layers": getattr(args, "layers", None) or (4 if quick else 12),
            "seq": 4 if quick else 8,
            "requests": getattr(args, "requests", None) or (1 if quick else 16),
            "rounds": 1 if quick else 2,    # a phase at concurrency c sends >= rounds * c
            "repeats": max(1, int(getattr(args, "repeats", None) or (1 if quick else 2))),
            "budget": getattr(args, "budget", None) or 0.25,
            "lookahead": 1 if quick else max(1, int(getattr(args, "lookahead", 1) or 1)),
            "workers": 1 if quick else max(1, int(getattr(args, "workers", 2) or 2)),
            "lm": LM_QUICK if quick else LM_FULL,
            "lm_factory": f"{__name__}:{'lm_quick' if quick else 'lm_full'}",
            "prompt": 4 if quick else 8, "new_tokens": 2 if quick else 8}


def _fronts(s, root):
    """{role: Front}, not started: the four roles of the module docstring."""
    from ..serve import Front, ServeSpec
    demo = dict(hidden=s["hidden"], layers=s["layers"], seq=s["seq"], lookahead=s["lookahead"])
    lm_bytes = _lm_bytes(s["lm"])
    specs = {
        "resident": (ServeSpec(models=1, budget=1.25, **demo), 1, MAX_BATCH),
        "offloaded": (ServeSpec(models=1, budget=s["budget"], **demo), 1, MAX_BATCH),
        "generate": (ServeSpec(models=1, model=s["lm_factory"], model_bytes_hint=lm_bytes,
                               budget=int(lm_bytes * s["budget"]), lookahead=1),
                     1, MAX_BATCH),
        "hints": (ServeSpec(models=3, budget=1.5, **demo), s["workers"], 8)}
    fronts = {}
    for role, (spec, workers, max_batch) in specs.items():
        spec.store_dir = os.path.join(root, role) if root else None
        tag = f"bench-{role}-{os.getpid()}"
        fronts[role] = Front(f"ipc://{tag}.sock", workers=workers, spec=spec, request_timeout=900.0,
                             start_timeout=600.0, name=tag, max_batch_size=max_batch)
    return fronts


def _summary(runs):
    return dict(summarize(runs), tokens_per_second=median([r["tokens_per_second"] for r in runs]))


def _phases(s, fronts, inputs, prompt):
    """The interleaved phases: {(section, mode, concurrency): [run, ...]}."""
    def infer(role, batched, c, seed):
        front = fronts[role]
        front.max_batch_size = MAX_BATCH if batched else 1
        return progress(f"{role} batching {'on' if batched else 'off'} c={c}", run_load(
            front.endpoint, ["m0"], max(s["requests"], s["rounds"] * c), c, False, inputs,
            seed=seed))

    def generate(batched, c, seed):
        front = fronts["generate"]
        front.max_batch_size = MAX_BATCH if batched else 1
        n = max(s["requests"] // 2, s["rounds"] * c) if batched else max(s["requests"] // 8, c)
        return progress(f"generate batching {'on' if batched else 'off'} c={c}", run_load(
            front.endpoint, ["m0"], n, c, False, [prompt], seed=seed,
            max_new_tokens=s["new_tokens"]))

    names = [f"m{i}" for i in range(3)]
    runs = {}
    for r in range(s["repeats"]):
        order = list(s["concurrency"]) if r % 2 == 0 else list(reversed(s["concurrency"]))
        for c in order:
            for mode in (INFER_MODES if r % 2 == 0 else reversed(INFER_MODES)):
                role, _, batching = mode.partition("_")
                runs.setdefault(("infer", mode, c), []).append(
                    infer(role, batching == "batched", c, r))
            for mode in GENERATE_MODES:
                runs.setdefault(("generate", mode, c), []).append(
                    generate(mode.endswith("_batched"), c, r))
        concurrency = 2 * s["workers"]
        for mode, hint in (("no_hints", False), ("hints", True)):
            runs.setdefault(("hints", mode, concurrency), []).append(progress(mode, run_load(
                fronts["hints"].endpoint, names, max(s["requests"], 6 * s["workers"]), concurrency,
                hint, inputs, seed=r)))
    return runs


def _warm(s, fronts, inputs, prompt):
    """One batched and one unbatched round per front: every worker has run every shape, and
    has checked its joined batches, forwards and generates (JOIN_CHECKS of distinct requests:
    until then it runs them one at a time too, so a measured phase would not be batched serving)."""
    from ..serve.execute import JOIN_CHECKS
    top = max(s["concurrency"])
    for role in ("resident", "offloaded"):
        for mbs in (MAX_BATCH, 1):
            fronts[role].max_batch_size = mbs
            batched = max(s["rounds"], 2 * JOIN_CHECKS) * top * fronts[role].n_workers
            progress(f"warm {role} max_batch_size {mbs}", run_load(
                fronts[role].endpoint, ["m0"], batched if mbs > 1 else 2, top, False, inputs, seed=99))
    fronts["generate"].max_batch_size = MAX_BATCH
    progress("warm generate", run_load(
        fronts["generate"].endpoint, ["m0"], max(s["rounds"], 2 * JOIN_CHECKS) * top, top, False, [prompt],
        seed=99, max_new_tokens=s["new_tokens"]))
    progress("warm hints", run_load(fronts["hints"].endpoint, ["m0", "m1", "m2"], 3 * s["workers"],
                                     2 * s["workers"], False, inputs, seed=99))


def bench_serve(args):
    """`prefetchd bench serve` (see the module docstring); the report as a dict."""
    from .serve_shared import bench_shared_host
    s = _sizes(args)
    if getattr(args, "only", None) == "shared":
        shared = bench_shared_host(args, s["quick"], s["repeats"], s["lookahead"])
        return {"kind": "serve", "quick": s["quick"], "only": "shared", "shared_host": shared,
                "ok": shared["ok"]}
    fronts = _fronts(s, getattr(args, "dir", None))
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal((1, s["seq"], s["hidden"])).astype(np.float32)]
    prompt = rng.integers(0, s["lm"]["vocab"], (1, s["prompt"])).astype(np.int64)
    try:
        t0 = time.monotonic()
        start_all(fronts)
        print(f"bench serve: {len(fronts)} fronts ready in {time.monotonic() - t0:.1f}s",
              file=sys.stderr, flush=True)
        _warm(s, fronts, inputs, prompt)
        runs = _phases(s, fronts, inputs, prompt)
        described = {role: {"workers": f.n_workers, "device_budget_bytes": f.spec.device_budget(),
                            "model_bytes": f.spec.model_bytes(), "counters": dict(f.counters)}
                     for role, f in fronts.items()}
    finally:
        close_all(fronts)
    report = _report(s, runs, described)
    report["shared_host"] = bench_shared_host(args, s["quick"], s["repeats"], s["lookahead"])
    report["ok"] = report["ok"] and report["shared_host"]["ok"]
    return report


def _report(s, runs, fronts):
    sections = {}
    for (section, mode, c), phase_runs in sorted(runs.items()):
        sections.setdefault(section, {}).setdefault(mode, {})[str(c)] = _summary(phase_runs)
    top = str(max(s["concurrency"]))
    infer, gen = sections["infer"], sections["generate"]
    hints_c = str(2 * s["workers"])
    hints, no_hints = sections["hints"]["hints"][hints_c], sections["hints"]["no_hints"][hints_c]
    ratios = {
        "offloaded_over_resident_batched": ratio(infer["offloaded_batched"][top]["rps"],
                                                  infer["resident_batched"][top]["rps"]),
        "offloaded_over_resident_unbatched": ratio(infer["offloaded_unbatched"][top]["rps"],
                                                    infer["resident_unbatched"][top]["rps"]),
        "batched_over_unbatched_offloaded": ratio(infer["offloaded_batched"][top]["rps"],
                                                   infer["offloaded_unbatched"][top]["rps"]),
        "batched_over_unbatched_resident": ratio(infer["resident_batched"][top]["rps"],
                                                  infer["resident_unbatched"][top]["rps"]),
        "generate_tokens_batched_over_unbatched": ratio(
            gen["offloaded_batched"][top]["tokens_per_second"],
            gen["offloaded_unbatched"][top]["tokens_per_second"]),
        "hints_over_no_hints_rps": ratio(hints["rps"], no_hints["rps"])}
    complete = all(p["completed"] == p["requests"] and p["errors"] == 0
                   for modes in sections.values() for by_c in modes.values() for p in by_c.values())
    return {"kind": "serve", "quick": s["quick"], "concurrency": list(s["concurrency"]),
            "max_batch_size": MAX_BATCH,
            "model": {"hidden": s["hidden"], "layers": s["layers"], "seq": s["seq"],
                      "rows_per_request": 1, "lookahead": s["lookahead"]},
            "lm": dict(s["lm"], prompt=s["prompt"], max_new_tokens=s["new_tokens"]),
            "budget_fraction": s["budget"], "repeats": s["repeats"], "fronts": fronts,
            "infer": infer, "generate": gen, "hints": sections["hints"],
            "ratios_at_concurrency": int(top), "ratios": ratios,
            "targets": {k: {"at_least": v, "met": (ratios[k] or 0) >= v}
                        for k, v in TARGETS.items()},
            "ok": complete}
