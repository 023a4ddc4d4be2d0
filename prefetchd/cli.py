"""The `prefetchd` command.

    prefetchd demo                    stream a model larger than its device budget, check outputs
    prefetchd bench {io,sched,model,serve,soak} [--json]
    prefetchd stage CHECKPOINT --store DIR
    prefetchd config {show,validate} [--config FILE]
    prefetchd collect-env
    prefetchd status|ctl|keys|serve   (ZeroMQ control plane; see prefetchd.service_cli)

Settings come from defaults < --config FILE / $PREFETCHD_CONFIG < PREFETCHD_* env < flags.
"""
import argparse
import json
import logging
import os
import sys


def _size(text):
    from .config import parse_size, ConfigError
    try:
        return parse_size(text, "size")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _emit(result, as_json):
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        _print_tree(result)


def _print_tree(value, indent=0):
    pad = "  " * indent
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                print(f"{pad}{k}:")
                _print_tree(v, indent + 1)
            else:
                print(f"{pad}{k}: {v}")
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, (dict, list)):
                _print_tree(v, indent + 1)
                print()
            else:
                print(f"{pad}- {v}")
    else:
        print(f"{pad}{value}")


# ---------------------------------------------------------------- commands
def cmd_collect_env(args):
    import importlib.metadata as md
    import platform
    from . import __version__, _native
    versions = {}
    for pkg in ("mindspore", "numpy", "pyzmq", "prometheus_client"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    store_dir = args.store or os.environ.get("PREFETCHD_STORE_DIR") or os.getcwd()
    probe = {}
    try:
        import tempfile
        with tempfile.TemporaryDirectory(dir=store_dir, prefix=".prefetchd-probe-") as d:
            store = _native.FileStore(d)
            probe = {"directory": store_dir, "engine": store.engine, "direct": store.direct,
                     "report": store.probe_report}
            store.close()
    except Exception as e:  # report, don't fail: collect-env is for bug reports
        probe = {"directory": store_dir, "error": str(e)}
    _emit({"prefetchd": __version__, "python": platform.python_version(),
           "platform": platform.platform(), "cpus": os.cpu_count(), "packages": versions,
           "native": _native.build_info(), "io_probe": probe}, args.json)


def cmd_config(args):
    from .config import Config, ConfigError
    try:
        config = Config.load(args.config)
    except ConfigError as e:
        print(f"prefetchd: invalid configuration: {e}", file=sys.stderr)
        return 2
    if args.action == "validate":
        print("configuration OK")
    else:
        _emit(config.as_dict(), args.json)
    return 0


def cmd_demo(args):
    from .demo import run_demo
    return run_demo(args)


def cmd_stage(args):
    from .staging import stage_checkpoint
    report = stage_checkpoint(args.checkpoint, args.store, progress=not args.quiet and sys.stderr.isatty())
    _emit(report, args.json)


def cmd_bench(args):
    from .bench import runner
    result = runner.run(args)
    _emit(result, args.json)
    return 0 if result.get("ok", True) else 1


# ---------------------------------------------------------------- parser
def build_parser():
    parser = argparse.ArgumentParser(
        prog="prefetchd", description="Tiered-memory prefetcher for MindSpore (device / host / NVMe).")
    parser.add_argument("--log-level", default=os.environ.get("PREFETCHD_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("collect-env", help="versions, native build, and the I/O engine the probe picks")
    p.add_argument("--store", help="directory to probe (default: $PREFETCHD_STORE_DIR or cwd)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_collect_env)

    p = sub.add_parser("config", help="show or validate the merged configuration")
    p.add_argument("action", choices=["show", "validate"])
    p.add_argument("--config", help="TOML file (default: $PREFETCHD_CONFIG)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("demo", help="stream a model larger than the device budget and check its outputs")
    p.add_argument("--size", type=_size, default=2 << 30, help="model weight bytes (default 2GiB)")
    p.add_argument("--hidden", type=int, default=1024, help="model width (default 1024)")
    p.add_argument("--budget", type=float, default=0.25, help="device budget as a fraction of the model (0.25)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lookahead", type=int, default=2)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--tier", choices=["remote", "host"], default="remote",
                   help="where the weights live between uses (default: remote = files on disk)")
    p.add_argument("--store", help="store directory (default: a temporary directory)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT while running")
    p.add_argument("--hold", type=float, default=0.0, help="keep serving metrics this many seconds at the end")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("stage", help="import a .ckpt or .safetensors file into a store (remote tier)")
    p.add_argument("checkpoint")
    p.add_argument("--store", required=True)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_stage)

    from .bench import runner
    p = sub.add_parser("bench", help="benchmarks (ratios against baselines measured in the same run)")
    runner.add_arguments(p)
    p.set_defaults(func=cmd_bench)

    try:
        from . import service_cli
    except ImportError:
        service_cli = None
    if service_cli is not None:
        service_cli.register(sub)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from .errors import PrefetchdError
        from .config import ConfigError
        if isinstance(e, (PrefetchdError, ConfigError, OSError)):
            print(f"prefetchd: error: {e}", file=sys.stderr)
            return 1
        raise
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
