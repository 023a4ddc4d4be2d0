"""`prefetchd serve`: a front and N spawned inference workers (prefetchd.serve).

Options come from flags > the [serve] table of the config file > defaults."""
import argparse
import logging
import signal
import sys
import threading

from ..config import ENV_PREFIX

from ..errors import ConfigError
from .common import BUDGET_HELP, UsageError, budget, port, positive_int, seconds, workers

from ..serve.spec import SERVE_OPTIONS as SERVE_DEFAULTS


def _milliseconds(text):
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 60_000:
        raise argparse.ArgumentTypeError(f"{text!r}: milliseconds from 0 to 60000")
    return value


def _size(text):
    from .common import size
    return size(text)


def _ip_address(text):
    """An IP address literal or localhost, as the [prefetchd] metrics_addr takes (a host name
    failed only once the workers were up, in the exporter, naming no setting)."""
    from ..config import ip_literal
    try:
        return ip_literal(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# Each option's parser: its flag's argparse type, and the check of its [serve] value from a
# config file, which is read as the flag's text is and named by key and file (it went
# unchecked: `workers = "two"` failed in a worker's traceback, and `heartbeat_timeout = 0`
# killed every worker as hung).
def _count(most):
    """Counts far beyond any machine (--models 99999999 grew each worker to 7 GB and was
    respawned for minutes; --lookahead past the daemon's 1024 blamed the budget)."""
    return lambda text: positive_int(text, most=most)


def _request_bytes(text):
    from ..serve.spec import MAX_REQUEST_BYTES_RANGE
    n, (least, most) = _size(text), MAX_REQUEST_BYTES_RANGE
    if not least <= n <= most:
        raise argparse.ArgumentTypeError(f"{text!r} is out of range: expected {least} bytes to 4GiB")
    return n


_PARSERS = {"workers": workers, "models": _count(1024), "hidden": _count(1 << 16),
            "layers": _count(4096), "batch": _count(1 << 16), "seq": _count(1 << 16),
            "lookahead": _count(1024), "max_batch_size": _count(1 << 16), "request_timeout": seconds,
            "heartbeat_timeout": seconds, "start_timeout": seconds, "max_queue_delay_ms": _milliseconds,
            "metrics_port": port, "metrics_addr": _ip_address, "model_bytes": _size, "budget": budget,
            "max_request_bytes": _request_bytes}
_FILE_SWITCHES = ("hints", "shared_host")     # the rest are text: endpoint, model, store, ...


def register(sub):
    p = sub.add_parser("serve", help="multi-process inference server: a front and N workers")
    p.add_argument("--config", help="TOML file (default: $PREFETCHD_CONFIG): [prefetchd] for the "
                                    "workers' daemons, [serve] for these options")
    p.add_argument("--endpoint", help="front endpoint for inference clients (default ipc://serve.sock "
                                      "in the runtime directory)")
    p.add_argument("--workers", type=_PARSERS["workers"], help="worker processes (2)")
    p.add_argument("--model", help="module:function returning (cell, signature), a servable or a "
                                   "generate-capable causal LM for one weight set, called as "
                                   "function(seed=N) (default: the demo model)")
    p.add_argument("--model-bytes", type=_PARSERS["model_bytes"],
                   help="weight bytes of one --model weight set, for a fractional --budget (e.g. 512MiB)")
    p.add_argument("--models", type=_PARSERS["models"],
                   help="weight sets per worker, m0, m1, ... (2; 1 with --checkpoint-store)")
    p.add_argument("--hidden", type=_PARSERS["hidden"], help="demo model width (256)")
    p.add_argument("--layers", type=_PARSERS["layers"], help="demo model blocks (4)")
    p.add_argument("--batch", type=_PARSERS["batch"], help="demo model: batch of a request (4)")
    p.add_argument("--seq", type=_PARSERS["seq"], help="demo model: sequence length of a request (16)")
    p.add_argument("--budget", type=_PARSERS["budget"],
                   help=BUDGET_HELP + " per worker (default: the configured device_budget, else 150%%)")
    p.add_argument("--lookahead", type=_PARSERS["lookahead"],
                   help="units prefetched ahead, and covered by a hint (2)")
    p.add_argument("--store", help="root of the workers' stores (default: the configured store_dir, "
                                   "else a temporary directory)")
    p.add_argument("--checkpoint-store", metavar="DIR",
                   help="serve the weights in DIR, a store made by `prefetchd stage`: --model's "
                        "parameters (built without initialising them) are read from it by name; "
                        "one weight set (m0); worker stores hard-link its files, so --store must "
                        "be on its filesystem (default: a temporary directory beside DIR)")
    p.add_argument("--shared-host", action="store_true", default=None,
                   help="one host tier for all workers, owned by the front: each tensor is read "
                        "from disk once and held in host RAM once (needs --checkpoint-store; "
                        "budget: the configured host_budget)")
    p.add_argument("--no-hints", dest="hints", action="store_false", default=None,
                   help="do not send prefetch hints to workers")
    p.add_argument("--request-timeout", type=_PARSERS["request_timeout"],
                   help="seconds before a request gets TIMEOUT (30)")
    p.add_argument("--max-batch-size", type=_PARSERS["max_batch_size"],
                   help="rows of one batch: requests for a model are joined up to this (8; 1: off)")
    p.add_argument("--max-queue-delay-ms", type=_PARSERS["max_queue_delay_ms"],
                   help="how long a request may wait for others to join its batch (2)")
    p.add_argument("--max-request-bytes", type=_PARSERS["max_request_bytes"],
                   help="bytes of a request's tensors, in all, and of each reply tensor (256MiB); "
                        "a worker's memory grows with the rows of the largest forward it ran, so "
                        "lower it to bound that (clients check 256MiB unless told otherwise)")
    p.add_argument("--heartbeat-timeout", type=_PARSERS["heartbeat_timeout"],
                   help="seconds a worker may not answer its heartbeat before it is replaced (15)")
    p.add_argument("--start-timeout", type=_PARSERS["start_timeout"],
                   help="seconds the workers may take to import the model, build it and load its "
                        "weights before the server gives up (180)")
    p.add_argument("--metrics-port", type=_PARSERS["metrics_port"],
                   help="export the front's and all workers' metrics on this port (0: any free one)")
    p.add_argument("--metrics-addr", type=_PARSERS["metrics_addr"], help="address of the metrics port (default: the config's "
                                          "metrics_addr or $PREFETCHD_METRICS_ADDR, else 127.0.0.1)")
    p.set_defaults(func=cmd_serve)


def _from_file(key, value, path):
    where = f"[serve] {key} (from file {path})"
    if key in _FILE_SWITCHES:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    parse = _PARSERS.get(key)
    if parse is None:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        if not value.strip():         # model = "" served the demo model instead
            raise ConfigError(f"{where}: empty (leave the key out for the default)")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where}: expected a value like the flag's, got {value!r}")
    try:
        return parse(str(value))
    except argparse.ArgumentTypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def config_path(args):
    """--config, else $PREFETCHD_CONFIG, else None."""
    import os
    return args.config or os.environ.get(ENV_PREFIX + "CONFIG")


def serve_table(path):
    """The [serve] table of config file `path` ({} without one), every key known and every
    value checked as its flag's (ConfigError naming key and file): serve and config validate."""
    from ..serve.spec import load_section
    table = dict(load_section(path, "serve")) if path else {}
    unknown = sorted(set(table) - set(SERVE_DEFAULTS))
    if unknown:
        raise ConfigError(f"[serve] {unknown[0]}: unknown setting (from file {path}); known: "
                          f"{', '.join(SERVE_DEFAULTS)}")
    values = {key: _from_file(key, value, path) for key, value in table.items()}
    if "endpoint" in values:          # refused by the front as it started; validate said OK
        from ..control.endpoints import check_bind_dir, resolve_endpoint
        from ..serve.front_sockets import FRONT_REMOTE_HINT
        try:
            check_bind_dir(resolve_endpoint(values["endpoint"], "serve", bind=True,
                                            remote_hint=FRONT_REMOTE_HINT))
        except ConfigError as e:
            raise ConfigError(f"[serve] endpoint (from file {path}): {e}") from None
    return values


def serve_options(args):
    """Options of `prefetchd serve`: flags > the [serve] table of the config file > defaults."""
    path = config_path(args)
    table = serve_table(path)
    options = {"from_flags": set()}
    for key, default in SERVE_DEFAULTS.items():
        flag = getattr(args, key, None)
        if flag is not None:
            options["from_flags"].add(key)
        options[key] = flag if flag is not None else table.get(key, default)
    options["config"] = path
    inherited = [key for key in ("metrics_addr", "metrics_port", "endpoint")
                 if key not in options["from_flags"] and key not in table]
    if inherited:
        # The [prefetchd] table's (or PREFETCHD_*'s) values, as for any daemon (flags > env >
        # file): a pod's Prometheus cannot reach loopback, and PREFETCHD_METRICS_PORT or
        # PREFETCHD_ENDPOINT moved out of a unit's command line were ignored without a word.
        from ..config import Config
        config = Config.load(path)
        for key in inherited:
            if getattr(config, key) is not None:
                options[key] = getattr(config, key)
    return options


def _refuse_combination(o, keys, message):
    """A combination of options that cannot work: a usage error (exit 2) when every one of
    `keys` was a flag, else a configuration error (exit 1) naming the file's part."""
    if all(key in o["from_flags"] for key in keys):
        raise UsageError(f"serve: {message}")
    raise ConfigError(f"{message} (from flags and/or the [serve] table of {o['config']})")


def check_combinations(o, model):
    """Options each valid alone that cannot go together, refused before anything starts."""
    checkpoint = o["checkpoint_store"]
    # A staged store knows its own size (its index); a fraction of it needs nothing more.
    if (model is not None and not checkpoint and isinstance(o["budget"], float)
            and not o["model_bytes"]):
        _refuse_combination(o, ("budget", "model"), "--budget as a fraction of a --model needs "
                            "--model-bytes (or give the budget as a size, e.g. 2GiB)")
    if o["shared_host"] and not checkpoint:
        _refuse_combination(o, ("shared_host",), "--shared-host needs --checkpoint-store: only "
                            "workers serving one staged store hold the same tensors")
    if checkpoint and o["models"] not in (None, 1):
        _refuse_combination(o, ("checkpoint_store", "models"), f"--checkpoint-store serves the one "
                            f"weight set the store holds; --models {o['models']} would need "
                            f"{o['models']} (use --models 1)")


def serve_spec(o, log_level="WARNING"):
    from ..serve.spec import DEMO_FACTORY, ServeSpec, load_factory
    model = o["model"] or DEMO_FACTORY
    check_combinations(o, None if model == DEMO_FACTORY else model)
    load_factory(model)                 # a bad --model fails here, not in every worker
    checkpoint = o["checkpoint_store"]
    models = o["models"] or (1 if checkpoint else 2)
    return ServeSpec(models=models, hidden=o["hidden"], layers=o["layers"], batch=o["batch"],
                     seq=o["seq"], budget=o["budget"], lookahead=o["lookahead"],
                     store_dir=o["store"], log_level=log_level, config_path=o["config"],
                     model=model, model_bytes_hint=o["model_bytes"], checkpoint_store=checkpoint,
                     shared_host=bool(o["shared_host"]), max_tensor_bytes=o["max_request_bytes"])


def check_flags(args):
    """Refuse a --endpoint or --model given on the command line that cannot work, before
    anything starts (UsageError, exit 2). The same values from the [serve] table of a
    config file are refused later as configuration errors (exit 1)."""
    if args.endpoint is not None:
        from ..control.endpoints import resolve_endpoint
        from ..serve.front_sockets import FRONT_REMOTE_HINT
        try:
            resolve_endpoint(args.endpoint, "serve", bind=True, remote_hint=FRONT_REMOTE_HINT)
        except ConfigError as e:
            raise UsageError(f"serve: argument --endpoint: {e}") from None
    if args.model is not None:
        _check_model(args.model)


def _check_model(path):
    """--model module:function names an importable module with that callable; a module
    that exists but fails to import is left to load_factory (a failure, exit 1)."""
    import importlib
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"serve: argument --model: {path!r}: expected module:function "
                         f"(e.g. mypkg.models:build)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise UsageError(f"serve: argument --model: {path!r}: no module named {missing!r} "
                             f"(is it on PYTHONPATH?)") from None
        return          # the module is there; one of its own imports is missing
    except Exception:   # noqa: BLE001 - the module's own error: load_factory reports it
        return
    if not callable(getattr(module, attr, None)):
        raise UsageError(f"serve: argument --model: {path!r}: module {module_name} has no "
                         f"callable {attr!r}")


def cmd_serve(args):
    # From the start: checking --model imports it, and MindSpore with it; a Ctrl-C in
    # there aborted the process ("Fatal Python error"). A signal now stops the server
    # at its next step.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    from ..serve import Front

    check_flags(args)
    o = serve_options(args)
    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    spec = serve_spec(o, level)
    front = Front(o["endpoint"], workers=o["workers"], spec=spec, hints=o["hints"],
                  request_timeout=o["request_timeout"], metrics_port=o["metrics_port"],
                  metrics_addr=o["metrics_addr"], max_batch_size=o["max_batch_size"],
                  max_queue_delay_ms=o["max_queue_delay_ms"],
                  heartbeat_timeout=o["heartbeat_timeout"], start_timeout=o["start_timeout"])
    print(f"prefetchd serve: starting {o['workers']} workers", file=sys.stderr)   # where: once ready
    if not stop.is_set():
        front.serve_forever(stop, on_ready=_say_ready)
    return 0


def _say_ready(front):
    metrics = f"; metrics on http://{front.metrics_addr}:{front.metrics_port}/metrics" \
        if front.metrics_port is not None else ""
    workers = front.snapshot()["workers"]
    ready = sum(w["ready"] for w in workers)
    short = "" if ready == len(workers) else f" of {len(workers)} (the others could not start: see above)"
    print(f"prefetchd serve: ready: {ready} workers{short}; front on {front.endpoint}{metrics}",
          file=sys.stderr, flush=True)
