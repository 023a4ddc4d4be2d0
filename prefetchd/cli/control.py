"""Control-plane verbs: status, ctl, keys.

    prefetchd status [--endpoint EP] [--json]            one daemon, or a serve front and its workers
    prefetchd ctl [--endpoint EP] OP [NAMES...]          ping|list|stats|prefetch|evict|pin|renew|
                                                         unpin|flush|set-watermarks
    prefetchd keys DIR [--client NAME ...]               CURVE certificates for tcp endpoints

The endpoint defaults to the configured `endpoint` (--config / PREFETCHD_ENDPOINT),
else ipc://$XDG_RUNTIME_DIR/prefetchd/<name>.sock. For a CURVE-protected tcp
endpoint pass --curve-dir DIR (the directory `prefetchd keys` made): the client
then uses DIR/server.key and DIR/client.key_secret, or DIR/NAME.key_secret with
--client NAME (a certificate made by `prefetchd keys DIR --client NAME`).
"""
import json
import math
import os

from ..errors import PrefetchdError
from .common import UsageError, daemon_name, seconds


def register(sub):
    p = sub.add_parser("status", help="residency, memory and queue of a running daemon or serve front")
    _client_args(p)
    p.add_argument("--json", action="store_true", help="print the raw status as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("ctl", intermixed=True,
                       help="send one control-plane request (prints the JSON reply)")
    _client_args(p)
    p.add_argument("op", type=lambda op: "set-watermarks" if op == "set_watermarks" else op,   # (the wire's name)
                   choices=["ping", "status", "list", "stats", "prefetch", "evict", "pin", "renew", "unpin",
                            "flush", "set-watermarks"], help="the operation")
    p.add_argument("args", nargs="*",
                   help="tensor names or globs (prefetch/evict/pin/flush/list), a lease id "
                        "(renew/unpin), or HIGH [LOW] (set-watermarks: a size like 2GiB, or a "
                        "fraction of the budget like 90%% or 0.9)")
    p.add_argument("--lease", type=seconds, default=None,
                   help="pin: lease seconds (renew before it ends; default the daemon's, 30); "
                        "renew: the lease's new length (default its own)")
    p.add_argument("--priority", type=int, default=None, help="prefetch: priority (higher first; 0)")
    p.add_argument("--no-wait", action="store_true", help="prefetch/evict/flush: reply once queued")
    p.set_defaults(func=cmd_ctl)

    p = sub.add_parser("keys", help="create CURVE certificates for a tcp control endpoint")
    p.add_argument("dir", help="directory to create (0700)")
    p.add_argument("--client", action="append", default=None,
                   help="client certificate name, a plain file name: DIR/NAME.key_secret "
                        "(repeatable; default: client)")
    p.set_defaults(func=cmd_keys)


def _client_args(p):
    p.add_argument("--endpoint", help="control endpoint (default: configured endpoint, else the "
                                      "default ipc socket of --name)")
    p.add_argument("--name", default=None, type=daemon_name, help="daemon name for the default ipc endpoint")
    p.add_argument("--config", help="TOML file (default: $PREFETCHD_CONFIG)")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds to wait for a reply (5)")
    p.add_argument("--curve-dir", help="directory made by `prefetchd keys` (server.key, client.key_secret)")
    p.add_argument("--client", default=None, metavar="NAME",
                   help="with --curve-dir: use the client certificate DIR/NAME.key_secret "
                        "(made by `prefetchd keys DIR --client NAME`; default: client)")


def _client(args):
    from ..config import Config
    from ..control import Client
    from ..control.endpoints import resolve_endpoint
    from ..errors import ConfigError

    endpoint, name = args.endpoint, args.name
    if endpoint is None or name is None:
        config = Config.load(args.config)
        endpoint = endpoint or config.endpoint
        name = name or config.name
    kwargs = {}
    if args.client is not None and not args.curve_dir:
        raise UsageError("--client NAME picks a certificate of --curve-dir DIR: give --curve-dir too")
    if args.curve_dir:
        client = "client" if args.client is None else _check_client_name(args.client, "--client")
        kwargs = {"server_public_key": _curve_file(args.curve_dir, "server.key"),
                  "client_keys": _curve_file(args.curve_dir, client + ".key_secret")}
    try:
        address = resolve_endpoint(endpoint, name)
    except ConfigError as e:      # from the flag: a bad command line (exit 2), else the config's
        if args.endpoint is None:
            raise
        raise UsageError(f"{args.command}: argument --endpoint: {e}") from None
    _refuse_missing_socket(address)
    return Client(endpoint, timeout=args.timeout, name=name, **kwargs)


def _refuse_missing_socket(endpoint, what="daemon", hint="under this --name or --endpoint"):
    """An ipc endpoint with no socket file has no daemon: say so now, not after --timeout.
    (A daemon pausing new connections moved its file aside, prefetchd/control/path_gate.py:
    then the client waits, and gets in when the file is back.) `what`, `hint`: the server
    it would be (a daemon, a serve front) and where to look."""
    from ..control.path_gate import asides
    from ..errors import ConfigError
    from ..socket_dirs import listener_at
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://"):]
    if asides(path):
        return
    if not os.path.exists(path):
        raise ConfigError(f"no {what} at {endpoint}: the socket file does not exist (is the {what} "
                          f"running, {hint}?)")
    if listener_at(path) is False:
        # A server killed before it closed leaves its file: the kernel refuses the connect, so
        # waiting --timeout for a reply would only end in "no reply".
        raise ConfigError(f"no {what} at {endpoint}: the socket file is there but nothing listens "
                          f"on it (left by a {what} that ended without closing; it is replaced "
                          f"when one starts there)")


def _curve_file(directory, name):
    """DIR/name of a --curve-dir, or ConfigError saying what is missing (not a key error)."""
    from ..errors import ConfigError
    made_by = f"(make one with `prefetchd keys {directory}`)"
    if not os.path.exists(directory):
        raise ConfigError(f"--curve-dir {directory}: the directory does not exist {made_by}")
    if not os.path.isdir(directory):
        raise ConfigError(f"--curve-dir {directory}: a file, not a directory {made_by}")
    path = os.path.join(directory, name)
    if os.path.isfile(path):
        return path
    held = sorted(f for f in os.listdir(directory) if f.endswith((".key", ".key_secret")))
    holds = f"it holds {', '.join(held)}" if held else "it holds no key files"
    clients = [f[:-len(".key_secret")] for f in held
               if f.endswith(".key_secret") and f != "server.key_secret"]
    if name == "server.key" or not clients:
        raise ConfigError(f"--curve-dir {directory}: no {name} in it ({holds}), so not a "
                          f"directory made by `prefetchd keys` {made_by}")
    raise ConfigError(f"--curve-dir {directory}: no {name} in it ({holds}): choose a client "
                      f"certificate with --client NAME, one of {', '.join(clients)}")


# ----------------------------------------------------------------------------- status

def _bytes(n):
    n = float(n or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _daemon_lines(st, indent=""):
    dev = st.get("device", {})
    states = st.get("states", {})
    srv = st.get("server", {})
    rank = st.get("rank")
    lines = [
        f"{indent}daemon   {st.get('name')}{' (closing)' if st.get('closed') else ''}, "
        f"backend {st.get('backend')}, io {st.get('io_engine')}"
        + (f", rank {rank['rank']} of {rank['world_size']}" if rank else ""),
        f"{indent}device   {_bytes(dev.get('used'))} / {_bytes(dev.get('capacity'))} "
        f"({100 * dev.get('usage_ratio', 0):.1f}%), peak {_bytes(dev.get('peak'))}, "
        f"watermarks {_bytes(dev.get('high_watermark'))} / {_bytes(dev.get('low_watermark'))}",
        f"{indent}tensors  {st.get('tensors')} (" + ", ".join(f"{k} {v}" for k, v in states.items())
        + f"); pinned {st.get('pinned')} ({_bytes(st.get('pinned_bytes'))})",
        f"{indent}queue    depth {st.get('queue_depth')}, in flight {st.get('in_flight')}",
    ]
    shared = st.get("shared_host")
    if shared:
        lines.append(f"{indent}shared   {shared.get('socket')}{'' if shared.get('attached') else ' (detached)'}: "
                     f"hits {shared.get('hits')} ({_bytes(shared.get('hit_bytes'))}), mapped "
                     f"{shared.get('mapped')}, fallbacks {shared.get('fallbacks')}, leases "
                     f"{shared.get('mapped_leases')}, covering {'yes' if shared.get('covering') else 'no'}")
    if srv:
        lines.append(f"{indent}server   {srv.get('endpoint')}: outstanding {srv.get('outstanding')}, "
                     f"leases {srv.get('leases')}, busy {srv.get('busy')}, "
                     f"malformed {srv.get('malformed')}, timeouts {srv.get('timeouts')}")
    return lines


def _given_up(worker):
    retry = worker.get("retry_in")
    return "given up, not restarted" if retry is None else f"given up, trying again in {retry:.0f}s"


def format_status(st):
    if "front" in st:
        front = st["front"]
        lines = [f"serve front {front['endpoint']} (pid {front['pid']}), hints "
                 f"{'on' if front['hints'] else 'off'}, queued {front['queued']}, "
                 f"models {', '.join(front['models'])}",
                 "counters " + (", ".join(f"{k} {v}" for k, v in sorted(front["counters"].items()))
                                or "none yet")]
        shared = front.get("shared_host")
        if shared:
            counters = shared.get("counters", {})
            lines.append(f"shared host {shared.get('socket')}: {_bytes(shared.get('bytes'))} / "
                         f"{_bytes(shared.get('budget'))} in {shared.get('blocks')} blocks, "
                         f"hits {counters.get('hits')}, fills {counters.get('fills')}, evictions "
                         f"{counters.get('evictions')}, covering {'yes' if shared.get('covering') else 'no'}")
        for w in st["workers"]:
            state = "ready" if w["ready"] else _given_up(w) if w.get("given_up") else "starting"
            lines.append(f"worker {w['index']}: pid {w['pid']}, {state}, "
                         f"in flight {w['inflight']}, served {w['served']}, failed {w['failed']}, "
                         f"deaths {w['deaths']}, last model {w['last_model']}")
            if w.get("given_up") and w.get("start_error"):
                lines.append(f"  could not start: {w['start_error']}")
            daemon = w.get("daemon") or {}
            if "error" in daemon:
                lines.append(f"  daemon: {daemon['error']}")
            else:
                lines.extend(_daemon_lines(daemon, "  "))
        return "\n".join(lines)
    return "\n".join(_daemon_lines(st))


def cmd_status(args):
    with _client(args) as client:
        st = client.status()
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
    else:
        print(_printable(_formatted(st, args.endpoint)))
    return 0


def _formatted(st, endpoint):
    """format_status of a daemon's or a serve front's status; PrefetchdError for anything else."""
    why = None if isinstance(st, dict) and ("front" in st or "device" in st) else "no 'device' or 'front' in it"
    if why is None:
        try:
            return format_status(st)
        except (TypeError, KeyError, AttributeError, ValueError, OverflowError) as e:
            why = f"{type(e).__name__}: {str(e)[:200]}"
    raise PrefetchdError(f"status: {endpoint or 'the endpoint'} answered with a status that is neither a "
                         f"prefetchd daemon's nor a serve front's ({why}); --json prints what it sent")


def _printable(text):
    """`text` without the control characters a server's strings could carry to the terminal."""
    return "".join(c if c.isprintable() or c == "\n" else "?" for c in text)


# ----------------------------------------------------------------------------- ctl

def _target(values):
    if len(values) == 1 and any(c in values[0] for c in "*?["):
        return {"pattern": values[0]}
    if any(any(c in v for c in "*?[") for v in values):
        raise UsageError("ctl: give one glob or a list of exact names")
    return {"names": values}


# The options each operation reads; another given is refused (it was dropped without a word).
_CTL_OPTIONS = {"lease": ("pin", "renew"), "priority": ("prefetch",),
                "no_wait": ("prefetch", "evict", "flush")}


def _check_ctl_args(op, values, args):
    """Refuse, before connecting, arguments the operation does not take (they were ignored)."""
    for option, ops in _CTL_OPTIONS.items():
        given = getattr(args, option)
        if given is not None and given is not False and op not in ops:     # (--priority 0 is given)
            flag = "--" + option.replace("_", "-")
            raise UsageError(f"ctl {op}: takes no {flag} (only {', '.join(ops)} do)")
    most = {"ping": 0, "stats": 0, "status": 0, "list": 1, "set-watermarks": 2}.get(op)
    if most is not None and len(values) > most:
        takes = {0: "no arguments", 1: "at most one glob", 2: "HIGH [LOW]"}[most]
        raise UsageError(f"ctl {op}: takes {takes}; got {' '.join(values)}")
    if op in ("prefetch", "evict", "pin") and not values:
        raise UsageError(f"ctl {op}: name the tensors (names or one glob)")
    if op in ("renew", "unpin") and not values:
        raise UsageError(f"ctl {op}: give the lease id that pin printed")
    if op == "set-watermarks" and not values:
        raise UsageError("ctl set-watermarks: give HIGH [LOW]")


def cmd_ctl(args):
    op, values = args.op, args.args
    _check_ctl_args(op, values, args)
    marks = [_watermark(v) for v in (values + [None])[:2]] if op == "set-watermarks" else None
    with _client(args) as c:
        if op in ("ping", "stats", "status"):
            result = c.call(op)
        elif op == "list":
            result = c.list(values[0] if values else "*")
        elif op in ("prefetch", "evict", "pin"):
            extra = {"lease": args.lease} if op == "pin" else {"wait": not args.no_wait}
            if op == "prefetch":
                extra["priority"] = args.priority or 0
            result = c.call(op, **_target(values), **extra)
        elif op == "flush":
            result = c.call("flush", wait=not args.no_wait, **(_target(values) if values else {}))
        elif op == "renew":
            result = c.call(op, lease=values, seconds=args.lease)
        elif op == "unpin":
            result = c.call(op, lease=values)
        else:  # set-watermarks
            result = c.set_watermarks(*marks)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def _watermark(text):
    """A watermark for the daemon: bytes (int), a size string, or a fraction (float; 90% = 0.9)."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        try:
            value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
        except ValueError:
            return text              # a size string: the daemon parses it, as the config does
    if not math.isfinite(value) or value < 0:
        # nan, inf and 1e400 (inf) were told "not negative"
        raise UsageError(f"ctl set-watermarks: {text!r}: expected bytes, a size (2GiB) or a "
                         f"fraction (90% or 0.9): "
                         + ("a finite number" if not math.isfinite(value) else "not negative"))
    return value


# ----------------------------------------------------------------------------- keys

def cmd_keys(args):
    from ..control.keys import AUTHORIZED_DIR, create_keys

    clients = args.client or ["client"]
    for c in clients:
        _check_client_name(c)
    _check_keys_dir(args.dir)
    try:
        directory = create_keys(args.dir, clients)
    except OSError as e:             # it said only "[Errno 2] ... '/proc/nope'"
        raise OSError(f"keys: cannot create the certificates in {args.dir}: "
                      f"{e.strerror} ({e.filename})") from None
    print(f"server certificate: {os.path.join(directory, 'server.key_secret')} (keep private)")
    print(f"server public key:  {os.path.join(directory, 'server.key')} (give to clients)")
    for c in clients:
        print(f"client {c}: {os.path.join(directory, c + '.key_secret')}, authorized in "
              f"{os.path.join(directory, AUTHORIZED_DIR)}")
    print(f"serve with:   daemon.serve('tcp://127.0.0.1:5555', curve_keys_dir={directory!r})")
    for c in clients:
        pick = "" if c == "client" else f" --client {c}"
        print(f"connect with: prefetchd status --endpoint tcp://127.0.0.1:5555 --curve-dir "
              f"{directory}{pick}")
    return 0


def _check_client_name(name, where="keys: argument --client"):
    """A client name becomes DIR/<name>.key_secret: a plain name, never a path."""
    from ..control.keys import SERVER_SECRET
    seps = {os.sep, os.altsep or os.sep, "/"}
    if not name or name in (".", "..") or any(sep in name for sep in seps) or "\0" in name:
        raise UsageError(f"{where}: {name!r}: a client name must be a plain "
                         f"name (no path separator, not '.' or '..', not empty): its "
                         f"certificate is DIR/NAME.key_secret")
    if name + ".key_secret" == SERVER_SECRET:
        raise UsageError(f"{where}: {name!r} is the server's certificate; "
                         f"choose another client name")
    return name


def _check_keys_dir(directory):
    """DIR is a directory or can be made one: not a file, nor under one."""
    from ..errors import ConfigError
    if not directory:
        raise UsageError("keys: argument DIR: an empty path; give the directory to create")
    path = os.path.abspath(directory)
    if os.path.islink(path) and not os.path.exists(path):
        raise ConfigError(f"keys: {directory} is a symlink to nothing (dangling, or a loop)")
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return
        path = parent
    if not os.path.isdir(path):
        what = directory if path == os.path.abspath(directory) else path
        raise ConfigError(f"keys: {what} is a file, not a directory; DIR is a directory to "
                          f"create or to add certificates to")
