"""Verbs that run in this process: demo, bench, stage, config, collect-env."""
import argparse
import os

from .common import (DEMO_BUDGET_HELP, UsageError, budget, budget_fraction, demo_budget,
                     emit, lookahead, path_given, port, positive_int, positive_size, seconds_or_zero, size,
                     workers, writable_file)


def register(sub):
    p = sub.add_parser("collect-env", help="versions, native build, and the I/O engine the probe picks")
    p.add_argument("--store", help="directory to probe (default: $PREFETCHD_STORE_DIR or cwd)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_collect_env)

    p = sub.add_parser("config", help="show or validate the merged configuration")
    p.add_argument("action", choices=["show", "validate"], help="show the merged settings, or "
                                                                "only check them")
    p.add_argument("--config", help="TOML file (default: $PREFETCHD_CONFIG)")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("demo", help="stream a model larger than the device budget and check its outputs")
    p.add_argument("--size", type=size, default=2 << 30, help="model weight bytes (default 2GiB)")
    p.add_argument("--hidden", type=positive_int, default=1024, help="model width (default 1024)")
    p.add_argument("--budget", type=demo_budget, default=0.25, help=DEMO_BUDGET_HELP + " (default 25%%)")
    p.add_argument("--batch", type=positive_int, default=8, help="batch size of an input (8)")
    p.add_argument("--seq", type=positive_int, default=16, help="sequence length of an input (16)")
    p.add_argument("--lookahead", type=lookahead, default=2,
                   help="units prefetched ahead (2; 0: each loaded when it runs)")
    p.add_argument("--passes", type=positive_int, default=3, help="forward passes to check (3)")
    p.add_argument("--tier", choices=["remote", "host"], default="remote",
                   help="where the weights live between uses (default: remote = files on disk)")
    p.add_argument("--store", help="store directory (default: a temporary directory)")
    p.add_argument("--metrics-port", type=port,
                   help="serve Prometheus metrics on 127.0.0.1:PORT while running (0: any free one)")
    p.add_argument("--hold", type=seconds_or_zero, default=0.0,
                   help="keep serving metrics this many seconds at the end (0 to 86400)")
    p.add_argument("--trace", metavar="FILE", type=writable_file,
                   help="write a Chrome/Perfetto trace (compute, copy streams, disk, scheduler) to FILE")
    p.add_argument("--plot", metavar="FILE.png", type=writable_file,
                   help="draw the timeline to a PNG (needs matplotlib: pip install 'prefetchd[plot]')")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("stage", help="import a .ckpt or .safetensors file into a store (remote tier)")
    p.add_argument("checkpoint", help="the .ckpt or .safetensors file")
    p.add_argument("--store", required=True, type=path_given, help="store directory to write")
    p.add_argument("--shard", metavar="SPEC",
                   help="stage a sharded model into DIR/rank_<N>/, all ranks or none: 'per-rank' "
                        "(CHECKPOINT is a directory of rank_<N>/ files, MindSpore's distributed layout), "
                        "or GLOB=AXIS[,GLOB=AXIS...] / a JSON file {GLOB: AXIS} splitting CHECKPOINT "
                        "into --ranks slices (unmatched tensors are replicated)")
    p.add_argument("--ranks", type=positive_int, help="with --shard SPEC: the number of ranks")
    p.add_argument("--any-rank", action="store_true",
                   help="the checkpoint is every rank's (data parallel): stage it into STORE/rank_N "
                        "whatever rank_M/ directory it lies in")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=cmd_stage)

    from ..bench import runner
    p = sub.add_parser("bench", conflict_handler="resolve",
                       help="benchmarks (ratios against baselines measured in the same run)")
    runner.add_arguments(p)
    # Same units as every other verb (these replace the runner's flags of the same name).
    p.add_argument("--budget", type=budget, default=None,
                   help="device budget: a size (2GiB) or a fraction (25%% or 0.25); model: of the "
                        "model's weights (default 25%%); serve: the offloaded workers', of the "
                        "model's weights (default 25%%)")
    p.add_argument("--size", type=positive_size, default="1GiB",
                   help="io: file size; model, accelerate: weight bytes (default 1GiB; model holds "
                        "about 10x that in RAM at its peak: the resident model and each case's offloaded "
                        "copy and host tier)")
    p.add_argument("--repeats", type=positive_int, default=None,
                   help="runs of each measurement (3; serve --quick: 1)")
    p.add_argument("--lookahead", type=positive_int, default=2, help="model/serve: units prefetched ahead (2)")
    p.add_argument("--workers", type=workers, default=2, help="serve: worker processes of the hints phases (2)")
    # serve: run only the shared_host section (prefetchd.bench.serve's docstring); not advertised.
    p.add_argument("--only", choices=["shared"], default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_bench)


def cmd_collect_env(args):
    import importlib.metadata as md
    import platform
    import tempfile

    from .. import __version__, _native
    from ..backend.base import open_store
    from ..config import Config
    versions = {}
    for pkg in ("mindspore", "numpy", "pyzmq", "prometheus_client"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    store_dir = args.store or os.environ.get("PREFETCHD_STORE_DIR") or os.getcwd()
    try:
        with tempfile.TemporaryDirectory(dir=store_dir, prefix=".prefetchd-probe-") as d:
            store = open_store(Config.load(store_dir=d))
            probe = {"directory": store_dir, "engine": store.engine, "direct": store.direct,
                     "report": store.probe_report}
            store.close()
    except Exception as e:  # noqa: BLE001 - report, don't fail: collect-env is for bug reports
        probe = {"directory": store_dir, "error": str(e)}
    emit({"prefetchd": __version__, "python": platform.python_version(),
          "platform": platform.platform(), "cpus": os.cpu_count(), "packages": versions,
          "native": _native.build_info(), "io_probe": probe}, args.json)


def cmd_config(args):
    from ..config import Config
    config = Config.load(args.config)          # ConfigError: one line, exit 1
    if args.action == "validate":
        from .serve import serve_options, serve_spec
        o = serve_options(args)                # [serve]: what `prefetchd serve` would refuse,
        spec = serve_spec(o)                   # alone and together, a model it cannot load
        if spec.checkpoint_store:              # and a checkpoint store it could not serve
            from ..serve.spec import check_checkpoint_store
            check_checkpoint_store(spec, o["store"])
        if config.endpoint:                    # what the daemon's control server would refuse
            from types import SimpleNamespace

            from ..control.endpoints import check_bind_dir
            from ..control.server_options import resolve
            options = resolve(SimpleNamespace(config=config), config.endpoint)
            for address in (options.endpoint, options.events_endpoint):
                check_bind_dir(address)
        if config.trace is not None:           # what Daemon() would refuse: a trace it cannot write
            from ..telemetry.timeline import Timeline
            Timeline.from_config(config.trace)
        if config.backend == "cpu":            # what its backend would refuse: budgets over RAM
            from ..limits import check_budgets
            check_budgets(config.device_budget, config.host_budget)
        print("configuration OK")
    else:
        emit(config.as_dict(), args.json)
    return 0


def cmd_demo(args):
    from ..demo.run import (_check_model_size, _mib, checked_options, model_bytes_for, run_demo,
                            smallest_budget)
    try:
        _check_model_size(args.size, args.hidden)
    except ValueError as e:
        raise UsageError(f"demo: {e}".replace("demo: size", "demo: argument --size")) from None
    # A size is those bytes, a fraction is of the model built (whole blocks: not exactly
    # --size); either way at most the model, refused before anything is staged.
    model_bytes = model_bytes_for(args.size, args.hidden)
    if isinstance(args.budget, int) and args.budget > model_bytes:
        raise UsageError(f"demo: argument --budget: {_mib(args.budget)} is more than the "
                         f"{_mib(model_bytes)} of weights of the model --size {_mib(args.size)} "
                         f"--hidden {args.hidden} builds; expected a size (2GiB) up to that or a "
                         f"fraction of the model in (0, 100%] (25% or 0.25)")
    from ..errors import ConfigError
    try:
        o = checked_options(args)
    except ConfigError:                      # a configured value (PREFETCHD_TRACE=...): named so
        raise
    except ValueError as e:                  # an option the machine or the model cannot take
        key, _, problem = str(e).partition(" ")
        raise UsageError(f"demo: argument --{key.replace('_', '-')}: {problem}") from None
    need = smallest_budget(o)
    if need is not None:
        percent = -(-need * 100 // model_bytes)          # rounded up, as the MiB are
        given = _mib(o["device_budget"])
        if isinstance(args.budget, float):        # maybe the default: say which value it was
            given = f"{args.budget:.0%} ({given}{', the default' if args.budget == 0.25 else ''})"
        raise UsageError(f"demo: argument --budget: {given} is too small for the "
                         f"{_mib(model_bytes)} model (a block and the next must fit beside the "
                         f"embeddings at --lookahead {o['lookahead']}); the smallest that fits is "
                         f"--budget {-(-need // 2**20)}MiB ({percent}%)"
                         + ("" if percent <= 100 else ": more than the model, so give a larger --size"))
    return run_demo(args)


def cmd_stage(args):
    from ..staging import PER_RANK, stage_checkpoint, stage_sharded
    if args.shard is not None:
        if args.any_rank:
            raise UsageError("stage: --any-rank is for one checkpoint staged into STORE/rank_N, not --shard")
        if args.shard == PER_RANK and args.ranks is not None:
            raise UsageError("stage: --ranks is for splitting one checkpoint by a spec; per-rank "
                             "checkpoints give their own number of ranks")
        if args.shard != PER_RANK and args.ranks is None:
            raise UsageError("stage: --shard SPEC needs --ranks N (how many slices to cut)")
        report = stage_sharded(args.checkpoint, args.store, spec=None if args.shard == PER_RANK else args.shard,
                               world_size=args.ranks, progress=not args.quiet)
        emit(report, args.json)
        return
    if args.ranks is not None:
        raise UsageError("stage: --ranks needs --shard SPEC")
    if os.path.isdir(args.checkpoint):
        from ..errors import ConfigError
        raise ConfigError(f"stage: {args.checkpoint} is a directory; CHECKPOINT is a checkpoint "
                          f"file (.ckpt or .safetensors)")
    # Staging picks the progress style itself: a \r line on a terminal, whole lines
    # every few seconds in a log file or pipe.
    report = stage_checkpoint(args.checkpoint, args.store, progress=not args.quiet, any_rank=args.any_rank)
    emit(report, args.json)


IO_SIZE_MIN = 1 << 20


def cmd_bench(args):
    if args.repeats is None:     # (a default of 3 in the parser hid an explicit --repeats 3 from --quick)
        args.repeats = 1 if args.kind == "serve" and args.quick else 3
    if args.kind == "serve":
        from ..bench.serve import bench_serve
        from ..serve.spec import ServeSpec
        spec = ServeSpec(hidden=args.hidden or 256, layers=args.layers or 12)
        args.budget = budget_fraction(args.budget, spec.model_bytes())
        result = bench_serve(args)
    else:
        from ..bench import runner
        from ..config import parse_size
        if args.kind == "io" and args.size < IO_SIZE_MIN:
            # MB/s of a few bytes round to 0 (the ratios divided by zero): no measurement.
            raise UsageError(f"bench io: argument --size: {args.size} bytes is too small to "
                             f"measure; expected at least 1MiB (default 1GiB)")
        if args.budget is None:
            args.budget = 0.25
        elif not isinstance(args.budget, float) and args.kind != "model":
            args.budget = args.budget / parse_size(args.size, "--size")
        # bench model takes bytes as bytes: its model is whole layers, not exactly --size.
        result = runner.run(args)
    emit(result, args.json)
    return 0 if result.get("ok", True) else 1
