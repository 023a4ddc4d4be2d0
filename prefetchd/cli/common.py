"""What every verb shares: one-line errors, units, and output."""
import argparse
import json
import logging
import re
import sys

from ..config import parse_size

from ..errors import ConfigError

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class UsageError(Exception):
    """A command line that cannot be run as given: exit code 2, one line on stderr."""


NEGATIVE_VALUE = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?(%|[a-zA-Z]+)?$")


class Parser(argparse.ArgumentParser):
    """argparse with errors as ONE line (`prefetchd: error: ...`) and exit code 2.
    `intermixed=True`: options and positionals mix in any order (`ctl prefetch --priority 5
    NAME`: plain argparse ends the positionals at the first option and NAME is left over)."""

    def __init__(self, *args, intermixed=False, **kwargs):
        super().__init__(*args, **kwargs)
        self._intermixed = intermixed
        # A value like -5% or -1GiB is a value (argparse's own matcher: only -5 or -.5), so
        # the flag's type says it is out of range, not "expected one argument".
        self._negative_number_matcher = NEGATIVE_VALUE

    def parse_known_args(self, args=None, namespace=None):
        if not self._intermixed:
            return super().parse_known_args(args, namespace)
        self._intermixed = False        # parse_known_intermixed_args calls back here
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixed = True

    def _print_message(self, message, file=None):
        # argparse drops a failed write (--help, --version into a closed pipe exited 0):
        # raised instead, so main() ends it as it ends any verb's output there (141).
        if message:
            file = file or sys.stderr
            file.write(message)
            file.flush()

    def error(self, message):
        where = self.prog.partition(" ")[2]          # the verb, for a subcommand's parser
        print(f"prefetchd: error: {where + ': ' if where else ''}{message}", file=sys.stderr)
        sys.exit(2)


def size(text):
    """Bytes: 1048576, 512MiB, 2GiB."""
    if NEGATIVE_VALUE.match(text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: a size must not be negative")
    try:
        return parse_size(text, "size")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def positive_size(text):
    """Bytes, at least one: a size to allocate and measure (bench --size)."""
    n = size(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: expected a size above 0 "
                                         f"(e.g. 512MiB)")
    return n


MAX_MODELS = 1024     # a fraction above this many models' weights is bytes without a unit


def budget(text, *, most=None):
    """A budget: "2GiB" (bytes, an int) or a fraction of the model: "25%" or 0.25
    (a float; above 1 means more than one model's weights, e.g. 150% or 1.5,
    unless `most` caps it: demo_budget allows at most 100%)."""
    value = text.strip()
    forms = ("a size (2GiB) or a fraction of the model "
             + ("in (0, 100%] " if most == 1 else "") + "(25% or 0.25)")
    if NEGATIVE_VALUE.match(value):
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: expected {forms}")
    try:
        fraction = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        fraction = None
    if fraction is not None:
        if not 0 < fraction < float("inf") or (most is not None and fraction > most):
            raise argparse.ArgumentTypeError(
                f"{text!r} is out of range: expected {forms}")
        if fraction > MAX_MODELS:      # bytes without a unit: it failed only once workers started
            raise argparse.ArgumentTypeError(
                f"{text!r} reads as a fraction of the model ({fraction:g} models' weights); for bytes "
                f"give a unit ({f'{int(fraction)}B' if fraction.is_integer() else 'e.g. 2GiB'})")
        return fraction
    try:
        nbytes = parse_size(value, "budget")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {forms}") from None
    if nbytes <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: expected {forms}")
    return nbytes


def demo_budget(text):
    """`prefetchd demo --budget`: bytes, or a fraction of the model in (0, 100%]."""
    return budget(text, most=1)


BUDGET_HELP = ("device budget: a size (2GiB) or a fraction of the model's weights "
               "(25%% or 0.25; 150%% = one and a half models)")
DEMO_BUDGET_HELP = ("device budget: a size (2GiB), at most the model's weights, or a fraction "
                    "of them in (0, 100%%] (25%% or 0.25)")


def budget_fraction(value, model_bytes):
    """A budget() value as a fraction of `model_bytes`."""
    if value is None or isinstance(value, float):
        return value
    return value / model_bytes


def port(text):
    """A TCP port, 0-65535 (0: any free one)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: a port is 0-65535 "
                                         f"(0: any free one)")
    return n


def path_given(text):
    """A path that is not empty ('' would be the current directory: a stage into it swaps
    the shell's own directory out)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (give the directory, e.g. ./store)")
    return text


def daemon_name(text):
    """A daemon name as the config takes it: it names a socket file (no '/' or '..')."""
    from ..config import ConfigError, parse_name
    try:
        return parse_name(text, "--name")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def writable_file(text):
    """A file this process can create or replace: a regular file or a new one, in a writable
    directory (never a device, FIFO or directory, which writing would replace)."""
    from ..telemetry.output_files import output_file_problem
    problem = output_file_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def log_level(text):
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"log level {text!r}: expected one of "
                                         f"{', '.join(LOG_LEVELS)}")
    return level


def positive_int(text, least=1, most=None):
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if n < least:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= {least}")
    if most is not None and n > most:
        raise argparse.ArgumentTypeError(f"{text!r}: must be at most {most}")
    return n


def workers(text):
    """Worker processes: 1 to serve's MAX_WORKERS (99999999 filled the RAM with slots)."""
    from ..serve.pool import MAX_WORKERS
    return positive_int(text, most=MAX_WORKERS)


def lookahead(text):
    """Units prefetched ahead: 0 (each loaded when it runs) or more."""
    return positive_int(text, least=0)


MAX_SECONDS = 1e6      # ~11.6 days: a poll's milliseconds fit a C int


def _number_of_seconds(text):
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None


def seconds(text):
    s = _number_of_seconds(text)
    if not 0 < s <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be > 0 and at most {MAX_SECONDS:g}")
    return s


def seconds_or_zero(text):
    """Seconds from 0 (none) to a day: --hold."""
    s = _number_of_seconds(text)
    if not 0 <= s <= 86400:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds from 0 to 86400")
    return s


def setup_logging(level):
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def emit(result, as_json):
    if as_json:
        print(json.dumps(result, indent=2, sort_keys=True, default=str))
    else:
        print_tree(result)


def print_tree(value, indent=0):
    pad = "  " * indent
    if isinstance(value, dict):
        for k, v in value.items():
            if isinstance(v, (dict, list)) and v:
                print(f"{pad}{k}:")
                print_tree(v, indent + 1)
            else:
                print(f"{pad}{k}: {v}")
    elif isinstance(value, list):
        for v in value:
            if isinstance(v, (dict, list)):
                print_tree(v, indent + 1)
                print()
            else:
                print(f"{pad}- {v}")
    else:
        print(f"{pad}{value}")
