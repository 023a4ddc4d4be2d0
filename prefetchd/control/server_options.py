"""Where and how a control Server listens, resolved once from its arguments and its
daemon's config (arguments first): the endpoint and the events endpoint beside it, the
CURVE keys, and the refusal of a remote endpoint that would let anyone in."""
import logging
from dataclasses import dataclass

from ..errors import ConfigError
from . import keys, protocol as P
from .endpoints import IPC_PATH_MAX, join_tcp, resolve_endpoint, split_tcp

log = logging.getLogger("prefetchd.control.server")


@dataclass(frozen=True)
class ServerOptions:
    name: str
    endpoint: str
    events_endpoint: str
    max_message_size: int
    curve_keys_dir: str | None


def resolve(daemon, endpoint, *, events_endpoint=None, max_message_size=None, curve_keys_dir=None,
            allow_remote=False, allow_insecure_remote=False, name=None):
    """ServerOptions for serving `daemon` on `endpoint`; ConfigError naming what is unsafe."""
    config = getattr(daemon, "config", None)
    name = name or getattr(config, "name", None) or "default"
    max_message_size = int(max_message_size or getattr(config, "max_message_size", 0)
                           or P.DEFAULT_MAX_MESSAGE_SIZE)
    curve_keys_dir = curve_keys_dir or getattr(config, "curve_keys_dir", None)
    allow_remote = allow_remote or bool(getattr(config, "allow_remote", False))
    # Read defensively: older Configs have no such key.
    insecure = bool(allow_insecure_remote or getattr(config, "allow_insecure_remote", False))
    if allow_remote and not curve_keys_dir and not insecure:
        raise ConfigError("allow_remote without curve_keys_dir would let anyone who reaches "
                          "the port control the daemon: create keys with `prefetchd keys DIR` "
                          "and set curve_keys_dir, or set allow_insecure_remote = true")
    if curve_keys_dir:
        keys.check_server_keys(curve_keys_dir)
    endpoint = resolve_endpoint(endpoint, name, bind=True, allow_remote=allow_remote)
    if events_endpoint:
        events_endpoint = resolve_endpoint(events_endpoint, name, bind=True, allow_remote=allow_remote)
    elif endpoint.startswith("ipc://"):
        events_endpoint = _events_beside(endpoint)
    else:
        events_endpoint = join_tcp(split_tcp(endpoint)[0], "*")
    if endpoint.startswith("tcp://") and not curve_keys_dir:
        log.warning("prefetchd control endpoint %s has no CURVE keys: any local user can "
                    "connect; set curve_keys_dir (prefetchd keys DIR)", endpoint)
    return ServerOptions(name, endpoint, events_endpoint, max_message_size, curve_keys_dir)


def _events_beside(endpoint):
    stem = endpoint[:-5] if endpoint.endswith(".sock") else endpoint
    events = stem + "-events.sock"
    if len(events[len("ipc://"):].encode()) > IPC_PATH_MAX:     # libzmq's bind said only "ipc path ..."
        raise ConfigError(f"endpoint {endpoint!r}: its events socket {events[len('ipc://'):]} is longer than "
                          f"{IPC_PATH_MAX} bytes; use a shorter name or directory (for prefetchd serve's "
                          f"workers: a shorter $XDG_RUNTIME_DIR), or set events_endpoint")
    return events


def ipc_socket_files(endpoint):
    """The files a Server bound at ipc `endpoint` (with its default events endpoint) makes:
    what to remove after its process died without closing it."""
    return [e[len("ipc://"):] for e in (endpoint, _events_beside(endpoint))]
