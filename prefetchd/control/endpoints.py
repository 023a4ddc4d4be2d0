"""Where the control plane listens: endpoint strings, private ipc directories,
loopback checks, and binding without exposing a socket to other users.

    ipc://            <runtime dir>/<name>.sock
    ipc://x.sock      <runtime dir>/x.sock
    ipc:///abs/x.sock that path; its directory must be ours and not group/world-writable
    ipc://@x          refused: the abstract namespace has no permissions to keep others out
    tcp://host:port   loopback only unless allow_remote (see prefetchd.control.server)

The runtime dir is $XDG_RUNTIME_DIR/prefetchd, else /tmp/prefetchd-<uid>, 0700.
"""
import ipaddress
import os
import random

import zmq

from ..config import is_tcp_port
from ..errors import ConfigError
from ..socket_dirs import (check_parent_dir, check_private_dir, ensure_private_dir, listener_at, private_socket_dir,
                           refuse_non_socket)

IPC_PATH_MAX = 107          # sun_path is 108 bytes with the terminating NUL
PICKED_PORT_TRIES = 64      # random ports outside the ephemeral range tried before the kernel picks
LOWEST_PICKED_PORT = 10000


def runtime_dir():
    """$XDG_RUNTIME_DIR/prefetchd, or /tmp/prefetchd-<uid>; created 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and not os.path.isdir(base):
        # A stale value (kept across su or sudo) is the usual cause; os.mkdir said only ENOENT.
        raise ConfigError(f"$XDG_RUNTIME_DIR is {base}, which is not a directory (kept from "
                          f"another session?): set it to an existing directory of yours, unset "
                          f"it (/tmp/prefetchd-<uid> is used then), or give an ipc:// path")
    if base:
        check_parent_dir(base, "$XDG_RUNTIME_DIR", "(kept from another session, across su or sudo?): "
                         "set it to a directory of yours, unset it (/tmp/prefetchd-<uid> is used "
                         "then), or give an ipc:// path")
    path = os.path.join(base, "prefetchd") if base else f"/tmp/prefetchd-{os.getuid()}"
    return ensure_private_dir(path)


def default_endpoint(name="default"):
    return f"ipc://{os.path.join(runtime_dir(), name + '.sock')}"


def ipc_path(endpoint, name):
    """The socket path of an ipc endpoint: 'ipc://' -> <runtime>/<name>.sock, 'ipc://x' -> <runtime>/x."""
    rest = endpoint[len("ipc://"):]
    if not rest:
        return os.path.join(runtime_dir(), f"{name}.sock")
    if "/" not in rest:
        return os.path.join(runtime_dir(), rest)
    return rest


def split_tcp(endpoint):
    """(host, port) of a tcp:// endpoint; brackets of an IPv6 host removed."""
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise ConfigError(f"endpoint {endpoint!r}: tcp endpoints need a port (tcp://127.0.0.1:5555)")
    return host.strip("[]"), port


def is_ipv6(address):
    """Whether `address` is tcp:// on an IPv6 host (tcp://[::1]:5555): libzmq binds and
    connects to one only with the IPV6 socket option ("No such device" without it). The
    option is not set for IPv4: it would rename 127.0.0.1 to [::ffff:127.0.0.1]."""
    return address.startswith("tcp://") and ":" in split_tcp(address)[0]


def is_loopback(host):
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def join_tcp(host, port):
    return f"tcp://{'[' + host + ']' if ':' in host else host}:{port}"


ALLOW_REMOTE_HINT = ("set allow_remote (Daemon(allow_remote=True), PREFETCHD_ALLOW_REMOTE=1, or "
                     "allow_remote = true in the config file) and curve_keys_dir to listen on {host}")


def resolve_endpoint(endpoint, name="default", *, bind=False, allow_remote=False,
                     remote_hint=ALLOW_REMOTE_HINT):
    """A zmq address for `endpoint` (see the module docstring); tcp defaults to loopback.
    `remote_hint`: what the refusal of a non-loopback bind tells to do ({host} filled in)."""
    if endpoint in (None, "", "ipc", "default"):
        endpoint = "ipc://"
    if endpoint.startswith("ipc://"):
        if endpoint[len("ipc://"):].startswith("@"):
            # libzmq reads ipc://@x as Linux's abstract namespace: no file, so no permission
            # keeps any process on the host out (ipc files live in a 0700 directory here).
            raise ConfigError(f"endpoint {endpoint!r}: abstract-namespace ipc endpoints are not "
                              f"supported (any local process could connect); use a path")
        path = ipc_path(endpoint, name)
        if len(path.encode()) > IPC_PATH_MAX:
            raise ConfigError(f"endpoint {endpoint!r}: ipc path {path} is longer than "
                              f"{IPC_PATH_MAX} bytes; use a shorter name or directory")
        return "ipc://" + path
    if endpoint.startswith("tcp://"):
        host, port = split_tcp(endpoint)
        if host in ("", "localhost"):
            host = "127.0.0.1"
        if not (port == "" or is_tcp_port(port)):
            raise ConfigError(f"endpoint {endpoint!r}: the port must be a number from 0 to 65535 "
                              f"(tcp://127.0.0.1:5555)")
        if not bind and (port in ("", "*") or int(port) == 0):
            raise ConfigError(f"endpoint {endpoint!r}: a client connects to the port its server "
                              f"listens on (0 and * let a server pick one at bind)")
        if bind:
            if not is_loopback(host) and not allow_remote:
                raise ConfigError(f"endpoint {endpoint!r}: tcp binds loopback unless told otherwise; "
                                  + remote_hint.format(host=host))
            if port in ("0", ""):
                port = "*"
        return join_tcp(host, port)
    raise ConfigError(f"endpoint {endpoint!r}: expected ipc://[path] or tcp://host:port")


def check_bind_dir(address):
    """Refuse now what `bind` would refuse of ipc `address`'s directory (config validate):
    an existing one that is not private (a missing one is created 0700 at bind)."""
    if address.startswith("ipc://"):
        parent = os.path.dirname(os.path.abspath(address[len("ipc://"):]))
        if os.path.isdir(parent):
            check_private_dir(parent)
        refuse_non_socket(address[len("ipc://"):], "endpoint")


def bind(sock, address):
    """Bind `sock`; for ipc returns (path, inode) of the socket file so that the
    owner can remove exactly that file later (libzmq leaves it behind), else None.

    ipc: the directory must be private (created 0700 if missing), the bind runs
    under umask 0177 (no chmod race), and a path a live server listens on, or where a
    file other than a socket is, is refused.
    """
    if not address.startswith("ipc://"):
        _bind_tcp(sock, address)
        return None
    path = address[len("ipc://"):]
    private_socket_dir(path)
    refuse_non_socket(path, "endpoint")
    if os.path.exists(path) and listener_at(path):      # else a dead server's file: libzmq replaces it
        raise ConfigError(f"endpoint {address}: another server is listening there")
    old = os.umask(0o177)
    try:
        sock.bind(address)
    finally:
        os.umask(old)
    return path, os.stat(path).st_ino


def _bind_tcp(sock, address):
    """Bind a tcp endpoint; a port left to us (`:0` or `:*`) is picked outside the
    kernel's ephemeral range.

    The connection guard may unbind an endpoint while descriptors are short (where
    the gate of prefetchd.control.syn_gate cannot close) and bind the same port
    again later (prefetchd.control.listening). A port from the ephemeral
    range can meanwhile become the source port of any outgoing connection on the
    machine, a connect to the unbound port itself included (TCP connects a socket to
    itself when source and destination match): the port then stays taken for as
    long as that connection lives, and the server cannot listen again. Source ports
    are only ever picked from the ephemeral range, so a port outside it comes back."""
    host, _, port = address.rpartition(":")
    if port not in ("0", "*"):
        try:
            sock.bind(address)
        except zmq.ZMQError as e:
            fix = _TCP_BIND_FIXES.get(e.errno)
            if fix is None:
                raise
            raise ConfigError(f"endpoint {address}: {os.strerror(e.errno)} ({fix})") from e
        return
    for port in _ports_outside_ephemeral(PICKED_PORT_TRIES):
        try:
            sock.bind(f"{host}:{port}")
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
    sock.bind(address)          # every try taken (or no such range): the kernel's pick


# A bare ZMQError named neither the endpoint nor what to change.
_TCP_BIND_FIXES = {
    zmq.EADDRINUSE: "another process listens on that port: choose another, or port 0 for any free one",
    zmq.EADDRNOTAVAIL: "not an address of this machine",
}


def _ports_outside_ephemeral(n):
    """Up to `n` random ports >= LOWEST_PICKED_PORT outside ip_local_port_range."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        return []
    ports = [p for p in range(LOWEST_PICKED_PORT, 65536) if not low <= p <= high]
    return random.sample(ports, min(n, len(ports)))


def unlink_ipc_files(files):
    """Remove the socket files `bind` returned, if they are still the same files."""
    for path, inode in files:
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError:
            pass
