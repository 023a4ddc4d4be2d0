"""`prefetchd bench KIND`: argument parsing and dispatch to the benchmark modules.

Every benchmark reports ratios against a baseline measured in the same run:
these machines are shared and noisy, so absolute numbers from different runs
do not compare.
"""
import argparse
import math
import os
import shutil
import tempfile


def _finite(text, least, *, above=False, means="a number"):
    """A finite number >= `least` (> `least` if `above`): nan, inf and negatives ran for no
    time and reported success, or divided by zero."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {means}") from None
    if not math.isfinite(value) or value < least or (above and value == least):
        raise argparse.ArgumentTypeError(f"{text!r}: {means} must be finite and "
                                         f"{'above' if above else 'at least'} {least:g}")
    return value


def _fraction_of_the_model(text):
    """--host-budget: a fraction >= 0 of the model's bytes (above 1 covers it)."""
    return _finite(text, 0, means="a fraction of the model (e.g. 0.5)")


def _count(text):
    """A whole number >= 1 (0 read as "the default" and a negative one crashed mid-run)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at least 1")
    return value


def _duration(text):
    return _finite(text, 0, above=True, means="a duration")


def add_arguments(parser):
    parser.add_argument("kind", choices=["io", "sched", "model", "serve", "soak", "accelerate"],
                        help="io: store vs fio; sched: scheduler throughput; model: offloaded vs resident passes; "
                             "serve: the multi-process server resident vs offloaded, batching on vs off, generation, hints; soak: mixed load with faults; "
                             "accelerate: prefetchd vs Accelerate's disk_offload (torch in --torch-python)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--dir", help="scratch directory on the disk to measure (default: a temp dir under cwd)")
    parser.add_argument("--size", default="1GiB", help="io: file size; model: weight bytes")
    parser.add_argument("--repeats", type=_count, default=3)
    parser.add_argument("--sweep", action="store_true", help="io: sweep block sizes, queue depths, engines")
    parser.add_argument("--requests", type=_count, default=None,
                        help="sched: requests per phase (200000); serve: requests per phase at concurrency 1 (48)")
    parser.add_argument("--batch", type=_count, nargs="*", default=None, help="model: batch sizes")
    parser.add_argument("--hidden", type=_count, default=None, help="model: layer width (4096); serve: demo model width (256)")
    parser.add_argument("--layers", type=_count, default=None, help="model/serve: number of layers")
    parser.add_argument("--budget", type=float, default=0.25, help="model: device budget / model size")
    parser.add_argument("--lookahead", type=int, default=2)
    parser.add_argument("--minutes", type=_duration, default=1.0, help="soak: duration")
    parser.add_argument("--seconds", type=_duration, default=None, help="soak: duration in seconds (overrides --minutes)")
    parser.add_argument("--workers", type=_count, default=2, help="serve: worker processes of the hints phases")
    parser.add_argument("--quick", action="store_true",
                        help="serve: a tiny model and few requests (checks the report, not speed)")
    parser.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache between runs")
    parser.add_argument("--steady", action="store_true",
                        help="model: steady state, no page-cache drop between passes (default: cold, dropped)")
    parser.add_argument("--host-budget", type=_fraction_of_the_model, default=0.5,
                        help="model: host budget of the remote-small-host case, as a fraction of the model (0.5)")
    parser.add_argument("--torch-python", default=None,
                        help="accelerate: interpreter with torch and accelerate (default: $PREFETCHD_TORCH_PYTHON, "
                             "else this one if it imports them)")


def run(args):
    from ..config import parse_size
    if args.kind == "serve":
        from .serve import bench_serve
        return bench_serve(args)
    scratch = args.dir or tempfile.mkdtemp(prefix=".prefetchd-bench-", dir=os.getcwd())
    try:
        return _run(args, scratch, parse_size)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)


def _run(args, scratch, parse_size):
    if args.kind == "io":
        from . import io
        kwargs = dict(size=parse_size(args.size, "--size"), repeats=args.repeats,
                      drop_caches=not args.no_drop_caches)
        if args.sweep:
            return io.sweep(scratch, **kwargs)
        return io.run(scratch, **kwargs)
    if args.kind == "sched":
        from . import sched
        return sched.run(scratch, requests=args.requests or 200_000, repeats=args.repeats)
    if args.kind == "model":
        from . import model
        args.hidden = args.hidden or 4096
        return model.run(scratch, args)
    if args.kind == "accelerate":
        from . import accelerate
        return accelerate.run(scratch, args)
    if args.kind == "soak":
        from . import soak
        seconds = args.seconds if args.seconds is not None else args.minutes * 60
        return soak.run(scratch, seconds=seconds)
    raise ValueError(args.kind)
