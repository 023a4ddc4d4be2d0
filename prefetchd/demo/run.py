"""`prefetchd demo`: stream a transformer larger than its device budget and check it.

1. Describe the model without allocating its weights, and stage each weight
   (deterministic values) into a store, one tensor at a time.
2. Run the fully resident model for reference outputs and timing.
3. Build it again without weights and offload it exactly as the README does
   (`Daemon(device_budget=..., store_dir=...)`, `offload(model, daemon,
   lookahead=k, checkpoint=True)`: no private switches), run the same passes.
   Then time the resident model again: its time per pass is the median of the
   passes before and after the offloaded ones, so a machine that got busier
   or quieter meanwhile moves both sides (shared machines drift by 30%). A
   model over a third of the memory the machine allows is not kept that long
   (it, the host cache and the device arena would not fit together): then
   only the passes before count.
4. Compare outputs bit for bit; print time per pass, stall time, hit rate,
   bytes moved, bandwidth and peak device bytes against the watermark, and
   where the time went (compute, stall, I/O per track).

    run_demo(size=2 << 30, budget=0.25, trace="run.json", plot="run.png")

`budget` is a fraction of the model's weights in (0, 1] (a float: 0.25 = 25%) or
bytes (an int, at most the model's weights): the device budget is then exactly
that. The model is `size` bytes rounded to whole blocks of width `hidden`
(`model_bytes_for`); fractions are of that, the model actually built.

Returns 0, or 1 if any output differs from the resident model's or the peak
device bytes exceeded the high watermark. Long phases (building the model,
staging) report progress on stderr: a `\\r` line on a terminal, a line every
few seconds otherwise.
"""
import json as _json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from ..staging import Progress, stage_tensors, write_index
from ..telemetry.metrics_server import check_listenable
from ..telemetry.output_files import output_file_problem
from ..telemetry.timeline import SCHEDULER
from ..telemetry.timeline_report import plot as plot_timeline, require_plot, summarize
from .model import MAX_SEQ

DEFAULTS = dict(size=2 << 30, hidden=1024, budget=0.25, batch=8, seq=16, lookahead=2, passes=3,
                tier="remote", store=None, metrics_port=None, hold=0.0, json=False, trace=None, plot=None,
                quiet=False)


def _mib(n):
    return f"{n / 2**20:,.1f} MiB"


def model_bytes_for(size, hidden):
    """Weight bytes of the demo model built for `size` bytes at width `hidden`
    (whole blocks, at least one: it can be larger or smaller than `size`)."""
    from .model import estimate_bytes, layers_for
    return estimate_bytes(hidden, layers_for(size, hidden))


MAX_BLOCKS = 1024      # a --size over a tiny --hidden built 114,123 blocks and never finished


def _check_model_size(size, hidden):
    from .model import estimate_bytes, layers_for
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"size {size!r}: expected the model's weight bytes, > 0")
    if size < estimate_bytes(hidden, 1) // 2:
        shown = size if size < 2**20 else _mib(size)
        raise ValueError(f"size {shown}: the smallest model of width {hidden} (its embeddings and "
                         f"one block) is {_mib(estimate_bytes(hidden, 1))}; give a size at least "
                         f"about that, or a smaller hidden")
    if layers_for(size, hidden) > MAX_BLOCKS:
        raise ValueError(f"size {_mib(size)} at hidden {hidden} would be {layers_for(size, hidden)} "
                         f"blocks, above {MAX_BLOCKS}; give a larger hidden or a smaller size")


def smallest_budget(o):
    """The smallest device budget (bytes) under which offload() plans the demo model of
    `o` (checked options) in units that fit, at o's lookahead; None if o's budget does:
    the same planner offload() runs, on the model's description (no weights), so a budget
    too small is refused before staging, not after the resident passes."""
    from ..backend.base import HostAndStoreTiers
    from ..hooks.budget_hint import DEFAULT_HIGH_FRACTION
    from ..hooks.planner import plan_units
    from .model import build_model, layers_for
    skeleton = build_model(o["hidden"], layers_for(o["size"], o["hidden"]), materialize=False)
    plan = plan_units(skeleton, int(o["device_budget"] * DEFAULT_HIGH_FRACTION), o["lookahead"],
                      block_bytes=HostAndStoreTiers.block_bytes)
    return None if plan.fits() else plan.min_device_budget()


def device_budget_for(budget, model_bytes):
    """The device budget in bytes of a `budget` option: a float is a fraction of
    `model_bytes` in (0, 1] (at least 1 MiB), an int is bytes in (0, model_bytes].
    ValueError naming the accepted forms otherwise."""
    if isinstance(budget, float) and 0 < budget <= 1:
        return max(int(model_bytes * budget), 1 << 20)
    if isinstance(budget, int) and not isinstance(budget, bool) and 0 < budget <= model_bytes:
        return budget
    raise ValueError(f"budget {budget!r}: expected bytes (an int) up to the model's "
                     f"{model_bytes} bytes of weights, or a fraction of them in (0, 1] (a float)")


def _check_resources(o, model_bytes):
    """Refuse, before staging, a model this machine cannot hold: its weights are staged to
    disk and built once in RAM (the resident reference; the host tier holds a second copy)."""
    from ..limits import available_memory
    memory = available_memory()
    need = model_bytes * (2 if o["tier"] == "host" else 1) + o["device_budget"]
    if need > 0.9 * memory.nbytes:
        raise ValueError(f"size {_mib(o['size'])}: the demo needs about {_mib(need)} of RAM (the model "
                         f"resident{', its host tier' if o['tier'] == 'host' else ''} and the device budget), "
                         f"more than 90% of the {_mib(memory.nbytes)} of {memory.source}; give a smaller --size")
    place = os.path.abspath(o["store"] or tempfile.gettempdir())
    while not os.path.exists(place):
        place = os.path.dirname(place)
    free = shutil.disk_usage(place).free
    if model_bytes > free:
        raise ValueError(f"size {_mib(o['size'])}: staging it needs {_mib(model_bytes)} of disk, and "
                         f"{place} has {_mib(free)} free; give a smaller --size or a --store with room")


def checked_options(args=None, /, **options):
    """The demo's options (`DEFAULTS` overridden by `args`, an argparse namespace, then by
    `options`), each checked before anything runs: ValueError saying what to change."""
    if args is not None:
        options = {**{k: v for k, v in vars(args).items() if k in DEFAULTS}, **options}
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"run_demo: unknown option(s) {', '.join(sorted(unknown))}")
    o = {**DEFAULTS, **options}
    from ..config import Config
    config = Config.load()
    o["note"] = _apply_configured(o, config)
    _check_model_size(o["size"], o["hidden"])
    model_bytes = model_bytes_for(o["size"], o["hidden"])
    o["device_budget"] = device_budget_for(o["budget"], model_bytes)
    hold = o["hold"]
    if isinstance(hold, bool) or not isinstance(hold, (int, float)) or not 0 <= hold <= 86400:
        raise ValueError(f"hold {hold!r}: expected seconds from 0 to 86400")
    port = o["metrics_port"]
    if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                             or not 0 <= port <= 65535):
        raise ValueError(f"metrics_port {port!r}: expected a port 0-65535 (0: any free one)")
    try:
        check_listenable(config.metrics_addr, port)      # else it failed only after staging
    except OSError as e:
        _refuse(o, "metrics_port", f"{port}: {e.strerror}")
    for key in ("trace", "plot"):
        problem = o[key] and output_file_problem(o[key])
        if problem:
            _refuse(o, key, problem)
    if o["tier"] not in ("remote", "host"):
        raise ValueError(f"run_demo: tier must be 'remote' or 'host', got {o['tier']!r}")
    if not isinstance(o["seq"], int) or not 1 <= o["seq"] <= MAX_SEQ:
        raise ValueError(f"seq {o['seq']!r}: the demo model has {MAX_SEQ} positions; give 1 to {MAX_SEQ}")
    _check_resources(o, model_bytes)
    if o["plot"]:
        require_plot()       # before the long run, not after it
    return o


def run_demo(args=None, /, **options):
    """Run the demo; keyword options as in `DEFAULTS` (budget: a fraction of the model
    in (0, 1], or bytes: see `device_budget_for`).

    trace: write a Chrome trace (Perfetto, chrome://tracing) of the offloaded
    passes to this path; plot: draw it to this PNG (needs the `plot` extra).
    json: print one JSON report instead of text; quiet: no text at all.
    `args`: an argparse namespace with the same names (the CLI's way in).
    """
    o = checked_options(args, **options)
    quiet = o["quiet"] or o["json"]
    say = (lambda *a: None) if quiet else print
    report, timeline = _run(o, say, quiet)

    if o["json"]:
        print(_json.dumps(report, indent=2))
    elif not quiet:
        _print_report(report)
        if timeline is None or not len(timeline):
            print(_stats_table(report))
        elif report["steady_from_ns"] is None:
            print(summarize(timeline, what="the offloaded pass"))
        else:
            print(summarize(timeline, report["steady_from_ns"],
                            what=f"passes 2-{o['passes']}; pass 1 records the trace"))
    if timeline is not None and o["plot"]:
        say(f"timeline plot: {plot_timeline(timeline, o['plot'])}")
    if timeline is not None and o["trace"]:
        say(f"trace: {o['trace']} (open in https://ui.perfetto.dev or chrome://tracing)")
    return 0 if report["outputs_match"] and report["watermark_respected"] else 1


# The configured settings the demo sets itself, with the flag that sets each: its budget is a
# share of its own model, and its store is its own (removed at the end unless --store).
_DEMO_SETS = {"device_budget": "--budget", "store_dir": "--store", "lookahead": "--lookahead"}


def _apply_configured(o, config):
    """Take the configured trace and metrics port where no option gave one (they only observe);
    return the note naming the configured settings the demo sets itself (dropped unsaid)."""
    sources = config.sources()
    o["configured"] = {}
    for key in ("trace", "metrics_port"):
        if o[key] is None and key in sources:
            o[key], o["configured"][key] = getattr(config, key), sources[key]
    kept = [key for key in _DEMO_SETS if key in sources]
    return (f"note: the demo sets {', '.join(kept)} itself ({', '.join(_DEMO_SETS[k] for k in kept)}): "
            f"{', '.join(sources[k] for k in kept)} not applied") if kept else None


def _refuse(o, key, problem):
    """ValueError naming option `key`; a ConfigError naming its source if it was configured."""
    from ..errors import ConfigError
    if key in o["configured"]:
        raise ConfigError(f"{key} (from {o['configured'][key]}): {problem}")
    raise ValueError(f"{key} {problem}")


def _progress(label, quiet, total_bytes=None, total_tensors=None):
    return None if quiet else Progress(total_bytes, total_tensors, label=f"prefetchd demo: {label}")


def _run(o, say, quiet):
    from .. import offload          # the face, as the README uses it (tests spy on it there)
    from ..backend.base import open_store
    from ..backend.framework import mindspore
    from ..config import Config
    from ..daemon import Daemon
    from ..limits import available_memory
    from .model import build_model, estimate_bytes, init_values, layers_for, make_inputs

    if o["note"]:
        say(o["note"])
    ms = mindspore()
    ms.set_device("CPU")
    hidden = o["hidden"]
    layers = layers_for(o["size"], hidden)
    model_bytes = estimate_bytes(hidden, layers)
    budget = o["device_budget"]
    say(f"prefetchd demo: {layers} transformer blocks + tied embedding, hidden {hidden}, "
        f"{_mib(model_bytes)} of fp32 weights; device budget {_mib(budget)} "
        f"({budget / model_bytes:.0%} of them); "
        f"weights on the {o['tier']} tier")

    own_store = o["store"] is None
    store_dir = o["store"] or tempfile.mkdtemp(prefix="prefetchd-demo-")
    scratch = tempfile.mkdtemp(prefix="prefetchd-demo-trace-")
    timeline = steady_from = None
    try:
        # 1. stage: one tensor in RAM at a time
        t0 = time.perf_counter()
        skeleton = build_model(hidden, layers, materialize=False)
        params = list(skeleton.get_parameters())
        store = open_store(Config.load(store_dir=store_dir))   # the configured I/O settings
        index = stage_tensors(store, ((p.name, tuple(p.shape), np.dtype(np.float32),
                                       init_values(p.name, tuple(p.shape))) for p in params),
                              progress=_progress("staging", quiet, model_bytes, len(params)) or False)
        engine = store.engine
        store.close()
        write_index(store_dir, index)
        say(f"staged {len(index)} tensors into {store_dir} in {time.perf_counter() - t0:.1f}s "
            f"(I/O engine: {engine})")

        x = make_inputs(o["batch"], o["seq"], hidden)

        # 2. reference: fully resident
        building = _progress("building the resident model", quiet, model_bytes, len(params))
        sizes = [int(np.prod(p.shape)) * 4 for p in params]
        reference = build_model(hidden, layers, progress=building and (
            lambda done, total: building.update(done, sum(sizes[:done]))))
        if building:
            building.finish()
        want, resident_times = [], []
        for _ in range(o["passes"]):
            t = time.perf_counter()
            want.append(reference(x).asnumpy())
            resident_times.append(time.perf_counter() - t)
        say(f"resident:  {np.median(resident_times):.3f}s per pass (before the offloaded passes)")
        if model_bytes * 3 > available_memory().nbytes:
            reference = None        # its memory goes back before the offloaded passes need theirs

        # 3. offloaded, as the README shows it
        model = build_model(hidden, layers, materialize=False)
        # Always record a timeline (the where-the-time-went table reads it); without
        # --trace its file goes to scratch space removed at the end.
        trace_path = o["trace"] or os.path.join(scratch, "trace.json")
        daemon = Daemon(device_budget=budget, store_dir=store_dir, metrics_port=o["metrics_port"],
                        name="demo", trace=trace_path).start()
        timeline = getattr(daemon, "timeline", None)
        if timeline is None or not timeline.enabled:
            timeline = None     # a daemon that records no timeline: the table comes from counters
            if o["trace"] or o["plot"]:
                say("note: this daemon records no timeline: --trace/--plot have nothing to draw")
        try:
            if daemon.metrics_port:
                say(f"metrics: http://127.0.0.1:{daemon.metrics_port}/metrics")
            handle = offload(model, daemon, lookahead=o["lookahead"], checkpoint=True)
            if o["tier"] == "host":
                daemon.stage_to_host(daemon.names()).result()
            got, times = [], []
            for i in range(o["passes"]):
                if i == 1:
                    steady_from = time.monotonic_ns()   # the first pass records the trace
                if timeline is not None:
                    timeline.instant(SCHEDULER, f"pass {i + 1}")
                t = time.perf_counter()
                got.append(model(x).asnumpy())
                times.append(time.perf_counter() - t)
            status, stats = daemon.snapshot()
            estimate = handle.estimate          # the cost model's view of a steady pass
            if o["hold"]:
                say(f"holding {o['hold']:.0f}s for metrics scrapes")
                time.sleep(o["hold"])
        finally:
            daemon.close()      # writes the trace file
        # The resident passes after, with the daemon closed (no prefetch still landing).
        for _ in range(o["passes"] if reference is not None else 0):
            t = time.perf_counter()
            again = reference(x).asnumpy()
            resident_times.append(time.perf_counter() - t)
            if not np.array_equal(again, want[0]):
                raise RuntimeError("prefetchd demo: the resident model's output changed between "
                                   "passes; it cannot serve as the reference")
        del reference
    finally:
        if own_store:
            shutil.rmtree(store_dir, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)

    mismatches = [i for i, (a, b) in enumerate(zip(want, got)) if not np.array_equal(a, b)]
    report = _report(o, status, stats, layers, hidden, model_bytes, budget, resident_times, times, mismatches)
    report["steady_from_ns"] = steady_from
    report["predicted_seconds_per_pass"] = estimate.pass_seconds if estimate is not None else None
    return report, timeline


def _report(o, status, stats, layers, hidden, model_bytes, budget, resident_times, times, mismatches):
    directions = ("load", "h2d")
    moved = sum(stats.transfer_bytes[d] for d in directions)
    moved_s = sum(stats.transfer_duration[d].sum for d in directions)
    hits = stats.requests["fetch", "hit"]          # a unit's tensors were resident when it ran
    misses = stats.requests["fetch", "miss"]       # it had to wait for (or fetch) them
    steady = times[1:] if len(times) > 1 else times
    return {
        "model_bytes": model_bytes, "layers": layers, "hidden": hidden, "batch": o["batch"],
        "device_budget": budget, "high_watermark": status["device"]["high_watermark"],
        "peak_device_bytes": status["device"]["peak"],
        "watermark_respected": status["device"]["peak"] <= status["device"]["high_watermark"],
        "tier": o["tier"], "lookahead": o["lookahead"], "io_engine": status["io_engine"],
        "resident_seconds_per_pass": float(np.median(resident_times)),
        "resident_pass_seconds": [float(t) for t in resident_times],
        "offloaded_seconds_per_pass": float(np.median(steady)),
        "first_pass_seconds": times[0], "offloaded_seconds_total": float(sum(times)),
        "stall_seconds": stats.stall.sum, "hit_rate": hits / max(1, hits + misses),
        "bytes_moved": moved, "bandwidth_MBps": moved / max(moved_s, 1e-9) / 1e6,
        "transfer_seconds": {d: stats.transfer_duration[d].sum for d in stats.transfer_duration},
        "transfer_bytes": dict(stats.transfer_bytes),
        "evictions": sum(stats.evictions.values()), "fences": stats.fences,
        "outputs_match": not mismatches, "mismatched_passes": mismatches, "passes": o["passes"],
        "trace": o["trace"],
    }


def _print_report(r):
    after = len(r["resident_pass_seconds"]) > r["passes"]
    print(f"resident:  {r['resident_seconds_per_pass']:.3f}s per pass (median of "
          f"{len(r['resident_pass_seconds'])} passes {'before and after' if after else 'before'} "
          f"the offloaded ones)")
    print(f"offloaded: {r['offloaded_seconds_per_pass']:.3f}s per pass "
          f"(first pass {r['first_pass_seconds']:.3f}s records the trace); "
          f"{r['offloaded_seconds_per_pass'] / r['resident_seconds_per_pass']:.2f}x resident")
    print(f"all passes, the recording one included: stall {r['stall_seconds']:.3f}s, hit rate {r['hit_rate']:.1%}, "
          f"moved {_mib(r['bytes_moved'])} at {r['bandwidth_MBps']:,.0f} MB/s, "
          f"{r['evictions']} evictions, {r['fences']} compute fences")
    if r.get("predicted_seconds_per_pass") is not None:
        print(f"predicted by the cost model: {r['predicted_seconds_per_pass']:.3f}s per pass "
              f"(measured {r['offloaded_seconds_per_pass']:.3f}s)")
    print(f"peak device {_mib(r['peak_device_bytes'])} vs high watermark {_mib(r['high_watermark'])}: "
          f"{'respected' if r['watermark_respected'] else 'EXCEEDED'}")
    print("outputs: identical to the resident model" if r["outputs_match"] else
          f"outputs: DIFFER from the resident model in pass(es) {r['mismatched_passes']}")


def _stats_table(r):
    """Where the time went, from the daemon's counters (when no timeline was recorded):
    transfer rows are summed durations, so overlapping transfers count twice."""
    total = r["offloaded_seconds_total"] or 1e-12
    stall = r["stall_seconds"]
    lines = [f"where the time went ({r['passes']} offloaded passes, {total:.3f} s; from counters)",
             f"  {'compute':<20} {total - stall:>9.3f} s {(total - stall) / total:>6.1%}  passes minus stalls",
             f"  {'stall':<20} {stall:>9.3f} s {stall / total:>6.1%}  compute waiting for weights"]
    for d, seconds in r["transfer_seconds"].items():
        if r["transfer_bytes"].get(d):
            lines.append(f"  {d + ' transfers':<20} {seconds:>9.3f} s {seconds / total:>6.1%}  "
                         f"{_mib(r['transfer_bytes'][d])}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run_demo())
