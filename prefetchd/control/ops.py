"""The control plane's operations: op name -> handler + argument validators.

A handler runs on the server's I/O thread as handler(server, args, owner) where
`args` holds every declared argument, validated and normalised (defaults filled
in), and `owner` is the peer's identity. It returns the reply's result, or a
Deferred when the daemon answers with a future (the server parks the request).
It must not block. Validators raise BadArguments (reply BAD_REQUEST) for values
of the wrong type or out of range, so that no number too large for the daemon's
arithmetic ever reaches it; an argument the op does not declare is refused the same
way, naming it and the ones the op takes (as the serve front does), never ignored.
"""
import concurrent.futures
import logging
import math
import os
import time
from dataclasses import dataclass, field

from ..core import patterns
from ..core.registry import MAX_NAME_BYTES
from .codes import BadArguments

log = logging.getLogger("prefetchd.control.ops")

MAX_SECONDS = 1e9                  # any duration argument (lease, deadline, renew)
MAX_PRIORITY = 2 ** 31 - 1
MAX_BYTES = 2 ** 63 - 1


@dataclass
class Deferred:
    """A result that comes later: `on_result(result, pending) -> reply` when the
    future succeeds; `on_abandon()` if it succeeds after the client stopped waiting."""
    future: concurrent.futures.Future
    on_result: object
    on_abandon: object = None


REQUIRED = object()                # default of an argument a request must give


@dataclass(frozen=True)
class Op:
    handler: object
    args: dict = field(default_factory=dict)     # name -> (validator(key, value), default)

    def check_known(self, op, raw):
        """BadArguments naming any argument of `raw` this op does not take (a misspelled
        `patern` or `leese` was silently ignored), and the ones it does."""
        unknown = [k for k in raw if k not in self.args]
        if unknown:
            raise BadArguments(f"unknown argument {', '.join(repr(k[:64]) for k in unknown[:8])}; "
                               f"{op} takes {', '.join(self.args) or 'none'}")

    def validate(self, raw, op="this op"):
        """The declared arguments, checked and with defaults filled in; an argument it does
        not declare is refused (check_known)."""
        self.check_known(op, raw)
        out = {}
        for key, (check, default) in self.args.items():
            value = raw.get(key)
            if value is None and default is REQUIRED:
                raise BadArguments(f"needs '{key}'")
            out[key] = default if value is None else check(key, value)
        return out


# ----------------------------------------------------------------------------- validators

def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(lo, hi):
    def check(key, value):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadArguments(f"'{key}' must be an integer")
        if not lo <= value <= hi:        # exact for any int: no float() that could overflow
            raise BadArguments(f"'{key}' must be an integer from {lo} to {hi}")
        return value
    return check


def number(lo, hi):
    def check(key, value):
        if not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
            raise BadArguments(f"'{key}' must be a number")
        if not lo <= value <= hi:
            raise BadArguments(f"'{key}' must be a number from {lo:g} to {hi:g}")
        return float(value)
    return check


def flag(key, value):
    if not isinstance(value, bool):
        raise BadArguments(f"'{key}' must be true or false")
    return value


def short_string(key, value):
    if not isinstance(value, str) or len(value) > 128:
        raise BadArguments(f"'{key}' must be a short string")
    return value


def glob(key, value):
    if not isinstance(value, str):
        raise BadArguments(f"'{key}' must be a string")
    if len(value) > patterns.MAX_PATTERN:
        raise BadArguments(f"'{key}' is {len(value)} characters; at most {patterns.MAX_PATTERN} are allowed")
    return value


def _shown(name, chars=64):
    """A name as a message shows it: at most `chars` characters (one was echoed back whole)."""
    return repr(name) if len(name) <= chars else f"{name[:chars]!r}... ({len(name)} characters)"


def name_list(key, value):
    """Tensor names; one that no tensor can have (empty, a NUL, over the store's key limit,
    not UTF-8) is BAD_REQUEST, not an UNKNOWN_TENSOR that echoed it whole."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise BadArguments(f"'{key}' must be a string or a list of strings")
    for i, name in enumerate(value):
        try:
            size = len(name.encode("utf-8"))
        except UnicodeEncodeError:
            raise BadArguments(f"'{key}'[{i}] {_shown(name)} is not valid UTF-8") from None
        why = ("is empty" if not name else "contains a NUL character" if "\0" in name else
               f"is {size} bytes; a tensor name is at most {MAX_NAME_BYTES}" if size > MAX_NAME_BYTES else None)
        if why:
            raise BadArguments(f"'{key}'[{i}] {_shown(name) + ' ' if name else ''}{why}")
    return value


def lease_ids(key, value):
    """A list of lease ids, each once: a repeated id is the same lease (unpin [id, id]
    released it, then failed on the second, already gone)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(i, str) for i in value):
        raise BadArguments(f"'{key}' must be a lease id or a list of them")
    return list(dict.fromkeys(value))


def watermark(key, value):
    """Bytes (int), a size string ("2GiB") or a fraction of the budget; the daemon parses it."""
    if isinstance(value, str):
        return value
    if not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise BadArguments(f"'{key}' must be bytes, a size string or a fraction")
    if not 0 <= value <= MAX_BYTES:
        raise BadArguments(f"'{key}' must be from 0 to {MAX_BYTES} bytes")
    return value


TARGET = {"names": (name_list, None), "pattern": (glob, None)}


def target_names(server, args, required=True):
    """The tensor names a request targets: `names`, or those matching `pattern`."""
    names, pattern = args["names"], args["pattern"]
    if names is not None and pattern is not None:
        raise BadArguments("give 'names' or 'pattern', not both")
    if pattern is not None:
        return patterns.select(server.daemon.names(), pattern)
    if names is None and required:
        raise BadArguments("needs 'names' (list of tensor names) or 'pattern' (glob)")
    return names


def _maybe_wait(future, wait, result):
    if not isinstance(future, concurrent.futures.Future):
        return dict(result, done=True)
    if not wait:
        return dict(result, done=False)
    started = time.monotonic()
    return Deferred(future, lambda _r, _p: dict(result, done=True,
                                                 seconds=time.monotonic() - started))


# ----------------------------------------------------------------------------- handlers

def op_ping(server, args, owner):
    if args["sync"] is not None:
        server.publish_sync(args["sync"])
    from .. import __version__
    from . import protocol as P
    return {"pong": True, "protocol": P.MAGIC.decode(), "version": __version__,
            "name": server.name, "pid": os.getpid(), "time": time.time(),
            "events": server.events_endpoint}


def op_status(server, args, owner):
    status = dict(server.daemon.status())
    status["server"] = server.server_status()
    return status


def op_stats(server, args, owner):
    from .stats_codec import stats_to_json
    status, stats = server.daemon.snapshot()
    return {"status": status, "stats": stats_to_json(stats), "server": server.server_status()}


def op_list(server, args, owner):
    tensors = list(server.daemon.tensors(args["pattern"]))
    return tensors[:args["limit"]] if args["limit"] is not None else tensors


def op_prefetch(server, args, owner):
    names = target_names(server, args)
    if not names:
        return {"count": 0}
    kwargs = {"priority": args["priority"]}
    if args["deadline"] is not None:
        kwargs["deadline"] = time.monotonic() + args["deadline"]
    future = server.daemon.prefetch(names, **kwargs)
    return _maybe_wait(future, args["wait"], {"count": len(names)})


def op_evict(server, args, owner):
    names = target_names(server, args)
    if not names:
        return {"count": 0}
    return _maybe_wait(server.daemon.evict(names), args["wait"], {"count": len(names)})


def op_flush(server, args, owner):
    names = target_names(server, args, required=False)
    return _maybe_wait(server.daemon.flush(names), args["wait"],
                       {"count": None if names is None else len(names)})


def op_pin(server, args, owner):
    names = target_names(server, args)
    seconds = args["lease"] if args["lease"] is not None else server.default_lease
    if seconds > server.max_lease:
        raise BadArguments(f"'lease' may not exceed {server.max_lease:g} seconds")
    if not names:
        raise BadArguments("no tensors to pin")
    future = server.daemon.pin(names)

    def granted(_result, pending):
        pending.lease = server.leases.grant(names, seconds, owner)
        return {"lease": pending.lease, "count": len(names), "expires_in": seconds}

    if isinstance(future, concurrent.futures.Future):
        # If the client stopped waiting, nobody holds the lease: drop the pin at once.
        return Deferred(future, granted, lambda: _unpin_quietly(server.daemon, names))
    lease_id = server.leases.grant(names, seconds, owner)
    return {"lease": lease_id, "count": len(names), "expires_in": seconds}


def _unpin_quietly(daemon, names):
    try:
        daemon.unpin(names)
    except Exception as e:  # noqa: BLE001
        log.debug("unpin of an abandoned pin failed: %s", e)


def _check_leases(server, ids):
    missing = server.leases.missing(ids)
    if missing:
        raise BadArguments(f"no lease {missing[0]} (expired or released)")


def op_renew(server, args, owner):
    ids, seconds = args["lease"], args["seconds"]
    if seconds is not None and seconds > server.max_lease:
        raise BadArguments(f"'seconds' may not exceed {server.max_lease:g}")
    _check_leases(server, ids)
    return {"renewed": len(ids), "expires_in": server.leases.renew(ids, seconds)}


def op_unpin(server, args, owner):
    ids = args["lease"]
    _check_leases(server, ids)
    return {"count": sum(len(server.leases.release(i).names) for i in ids)}


def op_set_watermarks(server, args, owner):
    high, low = args["high"], args["low"]
    if high is None:
        raise BadArguments("needs 'high' (bytes, a size string or a fraction of the budget)")
    future = server.daemon.set_watermarks(high, low)
    result = {"high": high, "low": low}
    if isinstance(future, concurrent.futures.Future):
        return Deferred(future, lambda _r, _p: result)
    return result


_WAIT = {"wait": (flag, True)}
OPS = {
    "ping": Op(op_ping, {"sync": (short_string, None)}),
    "status": Op(op_status),
    "stats": Op(op_stats),
    "list": Op(op_list, {"pattern": (glob, "*"), "limit": (integer(0, MAX_BYTES), None)}),
    "prefetch": Op(op_prefetch, {**TARGET, **_WAIT,
                                 "priority": (integer(-MAX_PRIORITY - 1, MAX_PRIORITY), 0),
                                 "deadline": (number(0, MAX_SECONDS), None)}),
    "evict": Op(op_evict, {**TARGET, **_WAIT}),
    "flush": Op(op_flush, {**TARGET, **_WAIT}),
    "pin": Op(op_pin, {**TARGET, "lease": (number(0.001, MAX_SECONDS), None)}),
    "renew": Op(op_renew, {"lease": (lease_ids, REQUIRED), "seconds": (number(0.001, MAX_SECONDS), None)}),
    "unpin": Op(op_unpin, {"lease": (lease_ids, REQUIRED)}),
    "set_watermarks": Op(op_set_watermarks, {"high": (watermark, None), "low": (watermark, None)}),
}
