"""The `prefetchd` command.

    prefetchd demo                    stream a model larger than its device budget, check outputs
    prefetchd bench {io,sched,model,serve,soak,accelerate} [--json]
    prefetchd stage CHECKPOINT --store DIR
    prefetchd config {show,validate} [--config FILE]
    prefetchd collect-env
    prefetchd status|ctl|keys         the ZeroMQ control plane (prefetchd.cli.control)
    prefetchd serve                   front + N inference workers (prefetchd.cli.serve)
    prefetchd infer --endpoint EP --model NAME x.npy ...   .npy in, .npy out (prefetchd.cli.infer)

Settings come from defaults < --config FILE / $PREFETCHD_CONFIG < PREFETCHD_* env < flags.
Errors are one line on stderr (`prefetchd: error: ...`): exit code 2 for a command
line that cannot be run, 1 for a failure; --debug adds the traceback. Output into a
pipe that was closed (`| head -1`) ends quietly, exit code 141.
"""
import argparse
import os
import sys
import traceback

from .common import Parser, UsageError, log_level, setup_logging


def add_shared_options(parser, root=False):
    """--version, --log-level, --debug: on the root parser (`prefetchd --debug demo`) and
    on every verb (`prefetchd demo --debug`). A verb's copies have no default, so they
    leave the root's value alone unless given, and given after the verb they win."""
    from .. import __version__
    unset = {} if root else {"default": argparse.SUPPRESS}
    parser.add_argument("--version", action="version", version=f"prefetchd {__version__}",
                        help="print the version and exit")
    # (no default from $PREFETCHD_LOG_LEVEL here: argparse would blame --log-level for a
    # bad value of it; main() reads it when the flag is not given)
    parser.add_argument("--log-level", type=log_level,
                        help="DEBUG, INFO, WARNING (default; or $PREFETCHD_LOG_LEVEL), ERROR",
                        **(unset or {"default": None}))
    parser.add_argument("--debug", action="store_true",
                        help="print the traceback of an error (and log at DEBUG)",
                        **(unset or {"default": False}))


def build_parser():
    from . import control, infer, local, serve

    parser = Parser(prog="prefetchd",
                    description="Tiered-memory prefetcher for MindSpore (device / host / NVMe).")
    add_shared_options(parser, root=True)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    local.register(sub)
    control.register(sub)
    serve.register(sub)
    infer.register(sub)
    for verb in set(sub.choices.values()):
        add_shared_options(verb)
    return parser


def main(argv=None):
    """Run one verb; returns the exit code (argparse exits with 2 on a bad command line)."""
    try:
        args = build_parser().parse_args(argv)
    except KeyboardInterrupt:           # Ctrl-C while the verbs' modules load: no traceback
        return 130
    except BrokenPipeError as e:        # --help or --version printed into a closed pipe
        return _ended_by_reader() if _stdout_closed() else _fail(argparse.Namespace(debug=False), e, 1)
    except ImportError as e:            # the verbs' modules: e.g. a bad PREFETCHD_FAULTS refused by the engine
        from ..errors import PrefetchdError
        debug = "--debug" in (sys.argv[1:] if argv is None else argv)
        return _fail(argparse.Namespace(debug=debug), PrefetchdError(f"cannot load prefetchd: {e}"), 1)
    try:
        level = args.log_level or _env_log_level()
    except UsageError as e:
        return _fail(args, e, 2)
    setup_logging("DEBUG" if args.debug else level)
    try:
        code = args.func(args) or 0
        sys.stdout.flush()              # a closed pipe shows here, not at exit
        return code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError as e:
        if not _stdout_closed():
            return _fail(args, e, 1)    # some other pipe: a failure like any other
        return _ended_by_reader()
    except UsageError as e:
        return _fail(args, e, 2)
    except Exception as e:  # noqa: BLE001 - every verb's failure is one line
        return _fail(args, e, 1)


def _env_log_level():
    text = os.environ.get("PREFETCHD_LOG_LEVEL", "WARNING")
    try:
        return log_level(text)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"$PREFETCHD_LOG_LEVEL: {e}") from None


def _ended_by_reader():
    """`prefetchd ... | head -1`: the reader has all it wants; end quietly as a SIGPIPE
    would (128 + 13), and keep the exit's own flush from complaining."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def _stdout_closed():
    """Whether stdout is a pipe whose reader has gone (poll says POLLERR)."""
    import select
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def _fail(args, exc, code):
    if args.debug:
        traceback.print_exception(exc, file=sys.stderr)
    message = str(exc) or type(exc).__name__
    if not isinstance(exc, (UsageError, OSError)) and type(exc).__module__ == "builtins":
        message = f"{type(exc).__name__}: {message}"      # an unexpected error says what it is
    print(f"prefetchd: error: {' '.join(message.split())}", file=sys.stderr)
    return code
