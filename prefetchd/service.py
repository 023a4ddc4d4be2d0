"""ZeroMQ control plane of a Daemon: an in-process Server and a Client.

The Server is one I/O thread that owns every socket it serves on: a ROUTER for
requests, a PUB for residency events and an inproc PULL that other threads use
to wake it. Daemon futures finish on the scheduler thread; their callbacks only
append to a deque and wake the I/O thread, which sends the reply. Nothing the
I/O thread calls blocks: requests that wait for the daemon are parked and
answered when their future completes or their deadline passes.

    d = Daemon(device_budget="1GiB", endpoint="ipc://")   # ipc://$XDG_RUNTIME_DIR/prefetchd/default.sock
    with Client("ipc://") as c:
        c.prefetch(["layer.0.weight"], wait=True)
        lease = c.pin("layer.1.*", lease=30)   # expires unless renewed: a dead client's pins do not leak
        c.renew(lease)
        c.unpin(lease)

See prefetchd/protocol.py for the frames. Security: ipc sockets live in a 0700
directory and are created with umask 0177; tcp binds loopback unless
`allow_remote=True`; with `curve_keys_dir` (made by `prefetchd keys DIR`) every
peer must present an authorized CURVE key, and a peer that does not is never
answered.
"""
import collections
import concurrent.futures
import fnmatch
import heapq
import ipaddress
import itertools
import logging
import math
import os
import secrets
import socket
import stat
import threading
import time
from dataclasses import dataclass, field, fields

import zmq
import zmq.auth

from . import protocol as P
from .config import ConfigError
from .errors import (BudgetError, PinnedError, PrefetchdError, ShutdownError, StorageError,
                     UnknownTensorError)

log = logging.getLogger("prefetchd.service")

__all__ = ["Server", "Client", "Subscription", "ServiceError", "BusyError", "RequestTimeout",
           "default_endpoint", "runtime_dir", "create_keys"]

SERVER_SECRET = "server.key_secret"
SERVER_PUBLIC = "server.key"
CLIENT_SECRET = "client.key_secret"
AUTHORIZED_DIR = "authorized_clients"
ZAP_DOMAIN = "prefetchd"
IPC_PATH_MAX = 107          # sun_path is 108 bytes with the terminating NUL


class ServiceError(PrefetchdError):
    """A refusal by the server that has no daemon error of its own (BAD_REQUEST, ...)."""

    def __init__(self, message, code=P.INTERNAL):
        super().__init__(message)
        self.code = code


class BusyError(ServiceError):
    """The server has too many requests outstanding; retry later."""


class RequestTimeout(PrefetchdError, TimeoutError):
    """No reply within the call's timeout, or the server gave up waiting (code TIMEOUT)."""

    code = P.TIMEOUT


_CODE_TO_ERROR = {
    P.UNKNOWN_TENSOR: UnknownTensorError, P.BUDGET: BudgetError, P.PINNED: PinnedError,
    P.SHUTDOWN: ShutdownError, P.STORAGE: StorageError, P.BUSY: BusyError,
    P.TIMEOUT: RequestTimeout,
}


def error_code(exc):
    """The reply code of an exception raised by the daemon."""
    if isinstance(exc, UnknownTensorError):
        return P.UNKNOWN_TENSOR
    if isinstance(exc, BudgetError):
        return P.BUDGET
    if isinstance(exc, PinnedError):
        return P.PINNED
    if isinstance(exc, ShutdownError):
        return P.SHUTDOWN
    if isinstance(exc, StorageError):
        return P.STORAGE
    if isinstance(exc, (ConfigError, ValueError, TypeError)):
        return P.BAD_REQUEST
    if isinstance(exc, TimeoutError):
        return P.TIMEOUT
    return P.INTERNAL


def exception_for(code, reason):
    """The exception a Client raises for an error reply."""
    cls = _CODE_TO_ERROR.get(code)
    if cls is None:
        return ServiceError(f"{code}: {reason}", code)
    if issubclass(cls, ServiceError):
        return cls(reason, code)
    exc = cls(reason)
    exc.code = code
    return exc


# --------------------------------------------------------------------------- endpoints

def ensure_private_dir(path):
    """Create `path` as a 0700 directory, or check that the existing one is ours and private."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"endpoint directory {path} exists and is not a directory")
    if st.st_uid != os.getuid():
        raise ConfigError(f"endpoint directory {path} belongs to uid {st.st_uid}, not to us "
                          f"({os.getuid()}); refusing to put a socket there")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def runtime_dir():
    """$XDG_RUNTIME_DIR/prefetchd, or /tmp/prefetchd-<uid>; created 0700."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "prefetchd") if base else f"/tmp/prefetchd-{os.getuid()}"
    return ensure_private_dir(path)


def stop_io_thread(owner, attr, message, thread, deadline):
    """Wake an I/O thread through its inproc socket `owner.<attr>`, wait for it
    until `deadline`, then close that socket (under `owner._wake_lock`)."""
    with owner._wake_lock:
        sock = getattr(owner, attr)
        if sock is not None:
            try:
                sock.send(message, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
    thread.join(max(0.0, deadline - time.monotonic()))
    with owner._wake_lock:
        sock = getattr(owner, attr)
        if sock is not None:
            sock.close(linger=0)
            setattr(owner, attr, None)


def default_endpoint(name="default"):
    return f"ipc://{os.path.join(runtime_dir(), name + '.sock')}"


def _ipc_path(endpoint, name):
    """The socket path of an ipc endpoint: 'ipc://' -> <runtime>/<name>.sock, 'ipc://x' -> <runtime>/x."""
    rest = endpoint[len("ipc://"):]
    if not rest:
        return os.path.join(runtime_dir(), f"{name}.sock")
    if "/" not in rest:
        return os.path.join(runtime_dir(), rest)
    return rest


def _split_tcp(endpoint):
    rest = endpoint[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep:
        raise ConfigError(f"endpoint {endpoint!r}: tcp endpoints need a port (tcp://127.0.0.1:5555)")
    return host.strip("[]"), port


def _is_loopback(host):
    if host in ("", "localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve_endpoint(endpoint, name="default", *, bind=False, allow_remote=False):
    """A zmq address for `endpoint` (see `_ipc_path`); tcp defaults to loopback."""
    if endpoint in (None, "", "ipc", "default"):
        endpoint = "ipc://"
    if endpoint.startswith("ipc://"):
        path = _ipc_path(endpoint, name)
        if len(path.encode()) > IPC_PATH_MAX:
            raise ConfigError(f"endpoint {endpoint!r}: ipc path {path} is longer than "
                              f"{IPC_PATH_MAX} bytes; use a shorter name or directory")
        return "ipc://" + path
    if endpoint.startswith("tcp://"):
        host, port = _split_tcp(endpoint)
        if host in ("", "localhost"):
            host = "127.0.0.1"
        if bind:
            if not _is_loopback(host) and not allow_remote:
                raise ConfigError(f"endpoint {endpoint!r}: tcp binds loopback unless told otherwise; "
                                  f"pass allow_remote=True (and set curve_keys_dir) to listen on {host}")
            if port in ("0", ""):
                port = "*"
        if ":" in host:
            host = f"[{host}]"
        return f"tcp://{host}:{port}"
    raise ConfigError(f"endpoint {endpoint!r}: expected ipc://[path] or tcp://host:port")


def _bind_ipc(sock, address):
    """Bind with umask 0177 (no chmod race); refuse to steal the path from a live server."""
    path = address[len("ipc://"):]
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(os.path.dirname(parent), exist_ok=True)
        ensure_private_dir(parent)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(0.5)
            probe.connect(path)
        except OSError:
            pass            # stale file of a dead server; libzmq replaces it
        else:
            raise ConfigError(f"endpoint {address}: another server is listening there")
        finally:
            probe.close()
    old = os.umask(0o177)
    try:
        sock.bind(address)
    finally:
        os.umask(old)


def _load_key(value, what):
    """A z85 key from bytes/str, or the right half of a certificate file."""
    if isinstance(value, str) and os.path.exists(value):
        public, secret = zmq.auth.load_certificate(value)
        return secret if what == "secret" and secret else public
    if isinstance(value, str):
        value = value.encode()
    if not isinstance(value, bytes) or len(value) != 40:
        raise ConfigError(f"{what} key: expected a 40-character z85 key or a certificate path")
    return value


def create_keys(directory, clients=("client",)):
    """Server and client CURVE certificates in `directory` (0700; secrets 0600).

    Layout: server.key / server.key_secret, <client>.key / <client>.key_secret,
    and authorized_clients/<client>.key holding the public keys the server accepts.
    """
    import shutil

    import zmq.auth

    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    authorized = os.path.join(directory, AUTHORIZED_DIR)
    os.makedirs(authorized, mode=0o700, exist_ok=True)
    old = os.umask(0o077)
    try:
        made = []
        if not os.path.exists(os.path.join(directory, SERVER_SECRET)):
            made += zmq.auth.create_certificates(directory, "server")
        for client in clients:
            if not os.path.exists(os.path.join(directory, f"{client}.key_secret")):
                made += zmq.auth.create_certificates(directory, client)
            shutil.copyfile(os.path.join(directory, f"{client}.key"),
                            os.path.join(authorized, f"{client}.key"))
    finally:
        os.umask(old)
    for path in made:
        if path.endswith("_secret"):
            os.chmod(path, 0o600)
    return directory


# --------------------------------------------------------------------------- server

@dataclass
class _Pending:
    envelope: list
    rid: bytes
    op: str
    deadline: float
    wait: float
    on_result: object          # (result, pending) -> reply payload, on the I/O thread
    on_abandon: object = None  # runs if the future succeeds after nobody waits for it
    lease: str | None = None


@dataclass
class _Lease:
    names: list
    seconds: float
    expires: float
    owner: bytes = b""


@dataclass
class ServerCounters:
    requests: dict = field(default_factory=collections.Counter)
    errors: dict = field(default_factory=collections.Counter)
    busy: int = 0
    malformed: int = 0
    replies_unroutable: int = 0
    replies_dropped: int = 0
    timeouts: int = 0
    events_published: int = 0
    events_dropped: int = 0
    leases_granted: int = 0
    leases_expired: int = 0
    leases_released: int = 0


class Server:
    """Serves one Daemon on `endpoint` from one I/O thread. `start()` returns self.

    Keyword options (all optional; defaults from the daemon's config when it has them):
      events_endpoint   where the PUB socket binds (default: next to the ROUTER)
      max_message_size  bytes of a request body (1 MiB); larger bodies get TOO_LARGE,
                        frames beyond 4x are cut off by zmq (MAXMSGSIZE) unanswered
      max_outstanding   requests waiting on the daemon before BUSY (1024; 256 per client)
      hwm               send/receive high-water marks of every socket (1000)
      max_wait          seconds a parked request may wait before TIMEOUT (600)
      default_lease     seconds of a pin lease when the client gives none (30; max 3600)
      curve_keys_dir    require CURVE: server.key_secret + authorized_clients/*.key
      allow_remote      allow binding tcp on a non-loopback address
    """

    def __init__(self, daemon, endpoint, *, events_endpoint=None, max_message_size=None,
                 max_outstanding=1024, max_outstanding_per_client=256, hwm=1000,
                 max_wait=600.0, default_lease=30.0, max_lease=3600.0, curve_keys_dir=None,
                 allow_remote=False, name=None):
        config = getattr(daemon, "config", None)
        self.daemon = daemon
        self.name = name or getattr(config, "name", None) or "default"
        self.max_message_size = int(max_message_size or getattr(config, "max_message_size", 0)
                                    or P.DEFAULT_MAX_MESSAGE_SIZE)
        curve_keys_dir = curve_keys_dir or getattr(config, "curve_keys_dir", None)
        allow_remote = allow_remote or bool(getattr(config, "allow_remote", False))
        self.endpoint = resolve_endpoint(endpoint, self.name, bind=True, allow_remote=allow_remote)
        if events_endpoint:
            self.events_endpoint = resolve_endpoint(events_endpoint, self.name, bind=True,
                                                    allow_remote=allow_remote)
        elif self.endpoint.startswith("ipc://"):
            stem = self.endpoint[:-5] if self.endpoint.endswith(".sock") else self.endpoint
            self.events_endpoint = stem + "-events.sock"
        else:
            host, _ = _split_tcp(self.endpoint)
            self.events_endpoint = f"tcp://{host if ':' not in host else '[' + host + ']'}:*"
        self.curve_keys_dir = curve_keys_dir
        if curve_keys_dir and not os.path.exists(os.path.join(curve_keys_dir, SERVER_SECRET)):
            raise ConfigError(f"curve_keys_dir: {curve_keys_dir} has no {SERVER_SECRET} "
                              f"(create it with `prefetchd keys {curve_keys_dir}`)")
        if (self.endpoint.startswith("tcp://") and not curve_keys_dir):
            log.warning("prefetchd control endpoint %s has no CURVE keys: any local user can "
                        "connect; set curve_keys_dir (prefetchd keys DIR)", self.endpoint)
        self.max_outstanding = max_outstanding
        self.max_outstanding_per_client = max_outstanding_per_client
        self.hwm = hwm
        self.max_wait = max_wait
        self.default_lease = default_lease
        self.max_lease = max_lease
        self.counters = ServerCounters()

        self._ctx = None
        self._auth = None
        self._thread = None
        self._ctl_address = f"inproc://prefetchd-server-{id(self):x}"
        self._started = threading.Event()
        self._start_error = None
        self._closed = False
        self._io_done = False
        self._orphaned = False
        self._state_lock = threading.Lock()
        # Hand-off from other threads: deques plus one wake message (never more than one in flight).
        self._wake_lock = threading.Lock()
        self._wake_sock = None
        self._wake_sent = False
        self._completions = collections.deque()
        self._events = collections.deque()
        self._max_events = 10000
        self._event_seq = itertools.count(1)
        # Owned by the I/O thread only.
        self._pending = {}
        self._abandoned = {}        # token -> cleanup of a timed-out request still running
        self._per_client = collections.Counter()
        self._timers = []           # heap of (deadline, token)
        self._leases = {}
        self._lease_heap = []       # heap of (expires, lease id)
        self._tokens = itertools.count()
        self._router = self._pub = self._ctl = None
        self._ipc_files = []

    # -- lifecycle (caller's thread)

    def start(self, timeout=10.0):
        if self._thread is not None:
            return self
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name=f"prefetchd-server-{self.name}",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            self.close(1.0)
            raise RuntimeError(f"prefetchd server on {self.endpoint} did not start within {timeout}s")
        if self._start_error is not None:
            self._thread.join(1.0)
            if self._auth is not None:
                self._auth.stop()
            self._destroy_context()
            raise self._start_error
        wake = self._ctx.socket(zmq.PUSH)
        wake.linger = 0
        wake.sndhwm = 16
        wake.connect(self._ctl_address)
        with self._wake_lock:
            self._wake_sock = wake
        add_listener = getattr(self.daemon, "add_listener", None)
        if add_listener is not None:
            add_listener(self._on_event)
        log.info("prefetchd server %s listening on %s (events %s)", self.name, self.endpoint,
                 self.events_endpoint)
        return self

    def close(self, timeout=None):
        """Stop serving; returns within `timeout` seconds (default 5) even if the I/O thread is stuck."""
        with self._state_lock:
            if self._closed or self._thread is None:
                self._closed = True
                return
            self._closed = True
        timeout = 5.0 if timeout is None else max(0.0, timeout)
        deadline = time.monotonic() + timeout
        remove = getattr(self.daemon, "remove_listener", None)
        if remove is not None:
            try:
                remove(self._on_event)
            except Exception:  # noqa: BLE001 - the daemon may be half-closed already
                pass
        self._stop_requested = True        # seen within a poll interval even without the message
        stop_io_thread(self, "_wake_sock", b"stop", self._thread, deadline)
        if self._auth is not None:
            try:
                self._auth.stop()
            except Exception:  # noqa: BLE001
                log.debug("stopping the authenticator failed", exc_info=True)
        with self._state_lock:
            if not self._io_done:
                # The thread is stuck in a daemon call; it destroys the context when it returns.
                self._orphaned = True
                log.warning("prefetchd server %s: I/O thread did not stop within %.1fs", self.name,
                            timeout)
                return
        self._destroy_context()

    def _destroy_context(self):
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    @property
    def running(self):
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # -- hand-off from other threads (scheduler, listeners)

    def _wake(self):
        if threading.get_ident() == self._io_ident:
            return            # the loop drains the deques before it polls again
        with self._wake_lock:
            if self._wake_sent or self._wake_sock is None:
                return
            try:
                self._wake_sock.send(b"w", zmq.NOBLOCK)
                self._wake_sent = True
            except zmq.ZMQError:
                pass          # a wake is already queued

    def _on_event(self, event):
        if len(self._events) >= self._max_events:
            self.counters.events_dropped += 1
            return
        self._events.append(event)
        self._wake()

    def _on_done(self, token, future):
        self._completions.append((token, future))
        self._wake()

    # -- I/O thread

    _io_ident = None
    _stop_requested = False

    def _run(self):
        self._io_ident = threading.get_ident()
        try:
            self._setup()
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._start_error = e
            self._close_sockets()
            with self._state_lock:
                self._io_done = True
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        except Exception:  # noqa: BLE001
            log.exception("prefetchd server %s: I/O loop crashed; no longer serving", self.name)
        finally:
            self._teardown()

    def _setup(self):
        ctx = self._ctx
        self._ctl = ctx.socket(zmq.PULL)
        self._ctl.linger = 0
        self._ctl.bind(self._ctl_address)
        curve = None
        if self.curve_keys_dir:
            from zmq.auth.thread import ThreadAuthenticator
            public, secret = zmq.auth.load_certificate(os.path.join(self.curve_keys_dir,
                                                                    SERVER_SECRET))
            self._auth = ThreadAuthenticator(ctx, log=logging.getLogger("prefetchd.service.auth"))
            self._auth.start()
            self._auth.configure_curve(domain=ZAP_DOMAIN, location=os.path.join(self.curve_keys_dir,
                                                                         AUTHORIZED_DIR))
            curve = (public, secret)
        self._router = self._make_socket(zmq.ROUTER, curve)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.maxmsgsize = 4 * self.max_message_size + 64
        self._bind(self._router, self.endpoint)
        self.endpoint = self._router.last_endpoint.decode()
        self._pub = self._make_socket(zmq.PUB, curve)
        self._bind(self._pub, self.events_endpoint)
        self.events_endpoint = self._pub.last_endpoint.decode()

    def _make_socket(self, kind, curve):
        sock = self._ctx.socket(kind)
        sock.linger = 0
        sock.sndhwm = self.hwm
        sock.rcvhwm = self.hwm
        if curve is not None:
            sock.curve_publickey, sock.curve_secretkey = curve
            sock.curve_server = True
            sock.zap_domain = ZAP_DOMAIN.encode()
            # Refuse connections if the authenticator is not there (libzmq would let them in).
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        return sock

    def _bind(self, sock, address):
        if address.startswith("ipc://"):
            _bind_ipc(sock, address)
            path = address[len("ipc://"):]
            self._ipc_files.append((path, os.stat(path).st_ino))
        else:
            sock.bind(address)

    def _unlink_ipc_files(self):
        # libzmq leaves the socket file behind when the context is destroyed with linger 0.
        for path, inode in self._ipc_files:
            try:
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
            except OSError:
                pass
        self._ipc_files.clear()

    def _loop(self):
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._ctl, zmq.POLLIN)
        while not self._stop_requested:
            ready = dict(poller.poll(self._poll_timeout_ms()))
            if ready.get(self._ctl):
                if self._drain_control():
                    break
            if ready.get(self._router):
                for _ in range(256):          # then let completions and timers run
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._handle(frames)
            self._drain_completions()
            self._drain_events()
            self._run_timers()

    def _poll_timeout_ms(self):
        if self._completions or self._events:
            return 0
        nearest = min([t[0] for t in self._timers[:1]] + [t[0] for t in self._lease_heap[:1]],
                      default=None)
        if nearest is None:
            return 1000
        return max(0, min(1000, math.ceil((nearest - time.monotonic()) * 1000)))

    def _drain_control(self):
        stop = False
        while True:
            try:
                msg = self._ctl.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            stop = stop or msg == b"stop"
        with self._wake_lock:
            self._wake_sent = False
        return stop

    def _teardown(self):
        for lease_id in list(self._leases):
            self._release_lease(lease_id, expired=False)
        for pending in self._pending.values():
            self._send(pending.envelope, P.encode_error(pending.rid, P.SHUTDOWN, "server closing"))
        self._pending.clear()
        self._close_sockets()
        with self._state_lock:
            self._io_done = True
            orphaned = self._orphaned
        if orphaned:
            if self._auth is not None:
                try:
                    self._auth.stop()
                except Exception:  # noqa: BLE001
                    pass
            self._destroy_context()

    def _close_sockets(self):
        for sock in (self._router, self._pub, self._ctl):
            if sock is not None:
                sock.close(linger=0)
        self._router = self._pub = self._ctl = None
        self._unlink_ipc_files()

    # -- replies

    def _send(self, envelope, frames):
        try:
            self._router.send_multipart(envelope + frames, zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self.counters.replies_unroutable += 1
            else:                                   # EAGAIN: the peer's queue is full
                self.counters.replies_dropped += 1
            return False

    def _reply_ok(self, envelope, rid, result):
        try:
            frames = P.encode_ok(rid, result)
        except (TypeError, ValueError):
            frames = P.encode_ok(rid, _jsonable(result))
        return self._send(envelope, frames)

    def _reply_error(self, envelope, rid, code, reason):
        self.counters.errors[code] += 1
        return self._send(envelope, P.encode_error(rid, code, reason))

    # -- requests

    def _handle(self, frames):
        envelope, payload = P.split_envelope(frames)
        total = sum(len(f) for f in payload)
        try:
            if total > self.max_message_size + 64 and payload and payload[0] == P.MAGIC:
                rid = payload[1] if len(payload) > 1 and len(payload[1]) == P.RID_SIZE else P.NO_RID
                raise P.ProtocolError(P.TOO_LARGE, f"message of {total} bytes exceeds the limit "
                                      f"of {self.max_message_size} bytes", rid)
            rid, op, args, timeout = P.decode_request(payload, self.max_message_size)
        except P.ProtocolError as e:
            self.counters.malformed += 1
            self._reply_error(envelope, e.rid, e.code, e.reason)
            return
        handler = self._OPS.get(op)
        self.counters.requests[op if handler else "?"] += 1
        if handler is None:
            self._reply_error(envelope, rid, P.BAD_REQUEST,
                              f"unknown op {op[:64]!r}; known: {', '.join(sorted(self._OPS))}")
            return
        owner = envelope[0]
        if len(self._pending) >= self.max_outstanding or (
                self._per_client[owner] >= self.max_outstanding_per_client):
            self.counters.busy += 1
            self._reply_error(envelope, rid, P.BUSY,
                              f"{len(self._pending)} requests outstanding; retry later")
            return
        try:
            outcome = handler(self, args, envelope)
        except _BadArgs as e:
            self._reply_error(envelope, rid, P.BAD_REQUEST, f"{op}: {e}")
            return
        except Exception as e:  # noqa: BLE001 - every request gets an answer
            code = error_code(e)
            if code == P.INTERNAL:
                log.exception("prefetchd server: %s failed", op)
            self._reply_error(envelope, rid, code, f"{op}: {e}")
            return
        if isinstance(outcome, _Deferred):
            self._park(envelope, rid, op, timeout, outcome)
        else:
            self._reply_ok(envelope, rid, outcome)

    def _park(self, envelope, rid, op, timeout, deferred):
        token = next(self._tokens)
        wait = min(timeout or self.max_wait, self.max_wait)
        deadline = time.monotonic() + wait
        self._pending[token] = _Pending(envelope, rid, op, deadline, wait, deferred.on_result,
                                        deferred.on_abandon)
        self._per_client[envelope[0]] += 1
        heapq.heappush(self._timers, (deadline, token))
        deferred.future.add_done_callback(lambda f, t=token: self._on_done(t, f))

    def _finish(self, token):
        pending = self._pending.pop(token, None)
        if pending is not None:
            owner = pending.envelope[0]
            self._per_client[owner] -= 1
            if self._per_client[owner] <= 0:
                del self._per_client[owner]
        return pending

    def _drain_completions(self):
        while self._completions:
            token, future = self._completions.popleft()
            pending = self._finish(token)
            exc = (ShutdownError("request cancelled by the daemon") if future.cancelled()
                   else future.exception())
            if pending is None:          # timed out, or the server is closing
                on_abandon = self._abandoned.pop(token, None)
                if on_abandon is not None and exc is None:
                    on_abandon()
                continue
            if exc is not None:
                self._reply_error(pending.envelope, pending.rid, error_code(exc),
                                  f"{pending.op}: {exc}")
                continue
            try:
                result = pending.on_result(future.result(), pending)
            except Exception as e:  # noqa: BLE001
                log.exception("prefetchd server: completing %s failed", pending.op)
                self._reply_error(pending.envelope, pending.rid, P.INTERNAL, str(e))
                continue
            if not self._reply_ok(pending.envelope, pending.rid, result) and pending.lease:
                self._release_lease(pending.lease, expired=False)   # the client is gone

    def _run_timers(self):
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, token = heapq.heappop(self._timers)
            pending = self._finish(token)
            if pending is not None:
                self.counters.timeouts += 1
                if pending.on_abandon is not None:
                    self._abandoned[token] = pending.on_abandon
                self._reply_error(pending.envelope, pending.rid, P.TIMEOUT,
                                  f"{pending.op} did not complete within {pending.wait:.3g}s; "
                                  f"it continues in the daemon")
        while self._lease_heap and self._lease_heap[0][0] <= now:
            expires, lease_id = heapq.heappop(self._lease_heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires <= now:
                log.info("prefetchd server: lease %s on %d tensors expired", lease_id,
                         len(lease.names))
                self._release_lease(lease_id, expired=True)

    def _drain_events(self):
        while self._events:
            event = self._events.popleft()
            try:
                kind = str(event.get("event", "event"))
                body = dict(event, seq=next(self._event_seq), daemon=self.name)
                frames = [kind.encode(), P.dumps(_jsonable(body))]
                self._pub.send_multipart(frames, zmq.NOBLOCK)
                self.counters.events_published += 1
            except (zmq.ZMQError, TypeError, ValueError, AttributeError):
                self.counters.events_dropped += 1

    # -- leases

    def _grant_lease(self, names, seconds, owner):
        lease_id = secrets.token_hex(8)
        lease = _Lease(list(names), seconds, time.monotonic() + seconds, owner)
        self._leases[lease_id] = lease
        heapq.heappush(self._lease_heap, (lease.expires, lease_id))
        self.counters.leases_granted += 1
        return lease_id

    def _release_lease(self, lease_id, expired):
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        if expired:
            self.counters.leases_expired += 1
        else:
            self.counters.leases_released += 1
        try:
            self.daemon.unpin(lease.names)
        except Exception as e:  # noqa: BLE001 - a closing daemon drops pins anyway
            log.debug("unpin of lease %s failed: %s", lease_id, e)
        return lease

    # -- operations: handler(self, args, envelope) -> result | _Deferred

    def _names(self, args, required=True):
        names, pattern = args.get("names"), args.get("pattern")
        if names is not None and pattern is not None:
            raise _BadArgs("give 'names' or 'pattern', not both")
        if pattern is not None:
            if not isinstance(pattern, str):
                raise _BadArgs("'pattern' must be a string")
            return [n for n in self.daemon.names() if fnmatch.fnmatchcase(n, pattern)]
        if names is None:
            if required:
                raise _BadArgs("needs 'names' (list of tensor names) or 'pattern' (glob)")
            return None
        if isinstance(names, str):
            names = [names]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise _BadArgs("'names' must be a string or a list of strings")
        return names

    @staticmethod
    def _number(args, key, default, *, minimum=None, integer=False):
        value = args.get(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _BadArgs(f"'{key}' must be a number")
        if integer and not float(value).is_integer():
            raise _BadArgs(f"'{key}' must be an integer")
        if minimum is not None and value < minimum:
            raise _BadArgs(f"'{key}' must be >= {minimum}")
        return int(value) if integer else float(value)

    @staticmethod
    def _flag(args, key, default):
        value = args.get(key, default)
        if not isinstance(value, bool):
            raise _BadArgs(f"'{key}' must be true or false")
        return value

    def _op_ping(self, args, envelope):
        sync = args.get("sync")
        if sync is not None:
            if not isinstance(sync, str) or len(sync) > 128:
                raise _BadArgs("'sync' must be a short string")
            try:
                self._pub.send_multipart([P.SYNC_TOPIC, P.dumps(sync)], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        from . import __version__
        return {"pong": True, "protocol": P.MAGIC.decode(), "version": __version__,
                "name": self.name, "pid": os.getpid(), "time": time.time(),
                "events": self.events_endpoint}

    def _server_status(self):
        c = self.counters
        return {"endpoint": self.endpoint, "events": self.events_endpoint,
                "outstanding": len(self._pending), "max_outstanding": self.max_outstanding,
                "leases": len(self._leases), "curve": bool(self.curve_keys_dir),
                "busy": c.busy, "malformed": c.malformed, "timeouts": c.timeouts,
                "replies_unroutable": c.replies_unroutable, "replies_dropped": c.replies_dropped,
                "events_published": c.events_published, "events_dropped": c.events_dropped,
                "leases_granted": c.leases_granted, "leases_expired": c.leases_expired,
                "leases_released": c.leases_released,
                "requests": dict(c.requests), "errors": dict(c.errors)}

    def _op_status(self, args, envelope):
        status = dict(self.daemon.status())
        status["server"] = self._server_status()
        return status

    def _op_stats(self, args, envelope):
        status, stats = self.daemon.snapshot()
        return {"status": status, "stats": stats_to_json(stats), "server": self._server_status()}

    def _op_list(self, args, envelope):
        pattern = args.get("pattern", "*")
        if not isinstance(pattern, str):
            raise _BadArgs("'pattern' must be a string")
        limit = self._number(args, "limit", None, minimum=0, integer=True)
        tensors = list(self.daemon.tensors(pattern))
        return tensors[:limit] if limit is not None else tensors

    def _op_prefetch(self, args, envelope):
        names = self._names(args)
        priority = self._number(args, "priority", 0, integer=True)
        deadline = self._number(args, "deadline", None, minimum=0)
        wait = self._flag(args, "wait", True)
        if not names:
            return {"count": 0}
        kwargs = {"priority": priority}
        if deadline is not None:
            kwargs["deadline"] = time.monotonic() + deadline
        future = self.daemon.prefetch(names, **kwargs)
        return self._maybe_wait(future, wait, {"count": len(names)})

    def _op_evict(self, args, envelope):
        names = self._names(args)
        wait = self._flag(args, "wait", True)
        if not names:
            return {"count": 0}
        return self._maybe_wait(self.daemon.evict(names), wait, {"count": len(names)})

    def _op_flush(self, args, envelope):
        names = self._names(args, required=False)
        wait = self._flag(args, "wait", True)
        return self._maybe_wait(self.daemon.flush(names), wait,
                                {"count": None if names is None else len(names)})

    @staticmethod
    def _maybe_wait(future, wait, result):
        if not isinstance(future, concurrent.futures.Future):
            return dict(result, done=True)
        if not wait:
            return dict(result, done=False)
        started = time.monotonic()
        return _Deferred(future, lambda _r, _p: dict(result, done=True,
                                                      seconds=time.monotonic() - started))

    def _op_pin(self, args, envelope):
        names = self._names(args)
        seconds = self._number(args, "lease", self.default_lease, minimum=0.001)
        if seconds > self.max_lease:
            raise _BadArgs(f"'lease' may not exceed {self.max_lease:g} seconds")
        if not names:
            raise _BadArgs("no tensors to pin")
        future = self.daemon.pin(names)
        owner = envelope[0]

        def granted(_result, pending):
            lease_id = self._grant_lease(names, seconds, owner)
            pending.lease = lease_id
            return {"lease": lease_id, "count": len(names), "expires_in": seconds}

        if isinstance(future, concurrent.futures.Future):
            # If the client stopped waiting, nobody holds the lease: drop the pin at once.
            return _Deferred(future, granted, lambda: self._unpin_quietly(names))
        lease_id = self._grant_lease(names, seconds, owner)
        return {"lease": lease_id, "count": len(names), "expires_in": seconds}

    def _unpin_quietly(self, names):
        try:
            self.daemon.unpin(names)
        except Exception as e:  # noqa: BLE001
            log.debug("unpin of an abandoned pin failed: %s", e)

    def _lease_ids(self, args):
        ids = args.get("lease")
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            raise _BadArgs("'lease' must be a lease id or a list of them")
        return ids

    def _op_renew(self, args, envelope):
        ids = self._lease_ids(args)
        seconds = self._number(args, "seconds", None, minimum=0.001)
        if seconds is not None and seconds > self.max_lease:
            raise _BadArgs(f"'seconds' may not exceed {self.max_lease:g}")
        missing = [i for i in ids if i not in self._leases]
        if missing:
            raise _BadArgs(f"no lease {missing[0]} (expired or released)")
        now = time.monotonic()
        for lease_id in ids:
            lease = self._leases[lease_id]
            if seconds is not None:
                lease.seconds = seconds
            lease.expires = now + lease.seconds
            heapq.heappush(self._lease_heap, (lease.expires, lease_id))
        return {"renewed": len(ids), "expires_in": min(self._leases[i].seconds for i in ids)}

    def _op_unpin(self, args, envelope):
        ids = self._lease_ids(args)
        missing = [i for i in ids if i not in self._leases]
        if missing:
            raise _BadArgs(f"no lease {missing[0]} (expired or released)")
        count = sum(len(self._release_lease(i, expired=False).names) for i in ids)
        return {"count": count}

    def _op_set_watermarks(self, args, envelope):
        high, low = args.get("high"), args.get("low")
        if high is None:
            raise _BadArgs("needs 'high' (bytes, a size string or a fraction of the budget)")
        for key, value in (("high", high), ("low", low)):
            if value is not None and (isinstance(value, bool)
                                      or not isinstance(value, (int, float, str))):
                raise _BadArgs(f"'{key}' must be bytes, a size string or a fraction")
        future = self.daemon.set_watermarks(high, low)
        result = {"high": high, "low": low}
        if isinstance(future, concurrent.futures.Future):
            return _Deferred(future, lambda _r, _p: result)
        return result

    _OPS = {"ping": _op_ping, "status": _op_status, "stats": _op_stats, "list": _op_list,
            "prefetch": _op_prefetch, "evict": _op_evict, "flush": _op_flush, "pin": _op_pin,
            "renew": _op_renew, "unpin": _op_unpin, "set_watermarks": _op_set_watermarks}


class _BadArgs(ValueError):
    pass


@dataclass
class _Deferred:
    future: concurrent.futures.Future
    on_result: object
    on_abandon: object = None


def _jsonable(obj):
    """obj with NaN/inf as None, tuples as lists and unknown objects as str."""
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def stats_to_json(stats):
    """prefetchd.stats.Stats as JSON: histograms as {buckets, counts, sum, count},
    tuple-keyed counters as nested {op: {outcome: n}}."""
    out = {}
    for f in fields(stats):
        out[f.name] = _stat_value(getattr(stats, f.name))
    return out


def stats_from_json(doc):
    """The inverse of stats_to_json: a prefetchd.stats.Stats (for metrics of a remote daemon)."""
    from .stats import Histogram, Stats

    def hist(v):
        h = Histogram(v["buckets"])
        h.counts, h.sum, h.count = list(v["counts"]), v["sum"], v["count"]
        return h

    stats = Stats()
    for f in fields(stats):
        if f.name not in doc:
            continue
        current, value = getattr(stats, f.name), doc[f.name]
        if isinstance(current, Histogram):
            value = hist(value)
        elif isinstance(current, dict) and current:
            sample = next(iter(current))
            if isinstance(sample, tuple):
                value = {(a, b): n for a, inner in value.items() for b, n in inner.items()}
            elif isinstance(current[sample], Histogram):
                value = {k: hist(v) for k, v in value.items()}
            else:
                value = dict(value)
        setattr(stats, f.name, value)
    return stats


def _stat_value(value):
    if hasattr(value, "buckets") and hasattr(value, "counts"):
        return {"buckets": list(value.buckets), "counts": list(value.counts),
                "sum": value.sum, "count": value.count}
    if isinstance(value, dict):
        nested = {}
        for k, v in value.items():
            if isinstance(k, tuple):
                node = nested
                for part in k[:-1]:
                    node = node.setdefault(str(part), {})
                node[str(k[-1])] = _stat_value(v)
            else:
                nested[str(k)] = _stat_value(v)
        return nested
    return _jsonable(value)


# --------------------------------------------------------------------------- client

class Client:
    """A DEALER client of a prefetchd Server. One call at a time (calls are serialized).

    Every call waits at most `timeout` seconds (per call override: `timeout=`) and
    raises RequestTimeout, a TimeoutError, if no reply came; the socket is then
    closed and recreated (Lazy Pirate), so a late reply cannot be mistaken for the
    next one. Error replies raise the matching prefetchd error (UnknownTensorError,
    BudgetError, ...) or ServiceError/BusyError, with `.code` set.

    CURVE: `server_public_key` is the server's z85 public key or its server.key
    file; `client_keys` is a .key_secret file or a (public, secret) pair. Without
    client keys an ephemeral pair is used, which an authorizing server refuses.
    """

    def __init__(self, endpoint=None, timeout=5.0, server_public_key=None, client_keys=None,
                 name="default"):
        self.endpoint = resolve_endpoint(endpoint, name)
        self.timeout = timeout
        self._curve = None
        if server_public_key is not None:
            server_key = _load_key(server_public_key, "public")
            if client_keys is None:
                public, secret = zmq.curve_keypair()
            elif isinstance(client_keys, (tuple, list)):
                public, secret = (_load_key(k, w) for k, w in zip(client_keys, ("public", "secret")))
            else:
                public, secret = zmq.auth.load_certificate(client_keys)
                if secret is None:
                    raise ConfigError(f"client_keys: {client_keys} holds no secret key")
            self._curve = (server_key, public, secret)
        self._lock = threading.RLock()
        self._ctx = None
        self._pid = None
        self._sock = None
        self._counter = itertools.count(secrets.randbits(31))
        self._closed = False
        self._subscriptions = []

    # -- sockets

    def _context(self):
        if self._ctx is None or self._pid != os.getpid():
            self._ctx, self._sock, self._pid = zmq.Context(), None, os.getpid()
        return self._ctx

    def _configure(self, sock):
        sock.linger = 0
        sock.sndhwm = sock.rcvhwm = 1000
        if self._curve is not None:
            server_key, public, secret = self._curve
            sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = \
                server_key, public, secret

    def _socket(self):
        if self._closed:
            raise ShutdownError("client is closed")
        ctx = self._context()
        if self._sock is None:
            sock = ctx.socket(zmq.DEALER)
            self._configure(sock)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _reset(self):
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self):
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sub in self._subscriptions:
                sub.close()
            self._reset()
            if self._ctx is not None and self._pid == os.getpid():
                self._ctx.destroy(linger=0)
            self._ctx = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- calls

    def call(self, op, timeout=None, **args):
        """Send one request and wait for its reply; returns the result."""
        timeout = self.timeout if timeout is None else timeout
        with self._lock:
            sock = self._socket()
            rid = P.new_rid(next(self._counter))
            # The server gives up a little before we do, so a slow operation is
            # answered with TIMEOUT rather than silence.
            server_wait = max(0.001, timeout * 0.9 - 0.05)
            frames = P.encode_request(rid, op, {k: v for k, v in args.items() if v is not None},
                                      server_wait)
            deadline = time.monotonic() + timeout
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                self._reset()
                raise RequestTimeout(f"{op}: send queue to {self.endpoint} is full") from None
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000)), zmq.POLLIN):
                    self._reset()
                    raise RequestTimeout(f"{op}: no reply from {self.endpoint} within {timeout:g}s")
                reply = sock.recv_multipart()
                try:
                    reply_rid, doc = P.decode_reply(reply)
                except P.ProtocolError:
                    continue
                if reply_rid != rid:
                    continue                     # a late reply to an earlier call
                if doc.get("ok"):
                    return doc.get("result")
                raise exception_for(doc.get("code", P.INTERNAL), doc.get("reason", ""))

    @staticmethod
    def _names(tensors):
        if tensors is None:
            return None
        if isinstance(tensors, str) or hasattr(tensors, "name"):
            tensors = [tensors]
        return [t if isinstance(t, str) else t.name for t in tensors]

    def _target(self, tensors, pattern):
        if pattern is not None:
            return {"pattern": pattern}
        if isinstance(tensors, str) and any(c in tensors for c in "*?["):
            return {"pattern": tensors}
        return {"names": self._names(tensors)}

    def ping(self, timeout=None):
        return self.call("ping", timeout)

    def status(self, timeout=None):
        return self.call("status", timeout)

    def stats(self, timeout=None):
        return self.call("stats", timeout)

    def list(self, pattern="*", limit=None, timeout=None):
        return self.call("list", timeout, pattern=pattern, limit=limit)

    def prefetch(self, tensors=None, *, pattern=None, priority=0, deadline=None, wait=True,
                 timeout=None):
        """Load onto the device tier; `deadline` is seconds from now. A string with
        glob characters is a pattern."""
        return self.call("prefetch", timeout, priority=priority, deadline=deadline, wait=wait,
                         **self._target(tensors, pattern))

    def evict(self, tensors=None, *, pattern=None, wait=True, timeout=None):
        return self.call("evict", timeout, wait=wait, **self._target(tensors, pattern))

    def flush(self, tensors=None, *, pattern=None, wait=True, timeout=None):
        target = self._target(tensors, pattern) if (tensors or pattern) else {}
        return self.call("flush", timeout, wait=wait, **target)

    def pin(self, tensors=None, *, pattern=None, lease=30.0, timeout=None):
        """Pin until unpinned or until `lease` seconds pass without renew(); returns the lease id."""
        return self.call("pin", timeout, lease=lease, **self._target(tensors, pattern))["lease"]

    def renew(self, lease, seconds=None, timeout=None):
        return self.call("renew", timeout, lease=lease, seconds=seconds)

    def unpin(self, lease, timeout=None):
        return self.call("unpin", timeout, lease=lease)

    def set_watermarks(self, high, low, timeout=None):
        return self.call("set_watermarks", timeout, high=high, low=low)

    def subscribe(self, topics=P.TOPICS, events_endpoint=None):
        """A Subscription to residency events (topics: loaded, evicted, written_back, failed)."""
        with self._lock:
            if events_endpoint is None:
                events_endpoint = self.ping()["events"]
                host = events_endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
                if events_endpoint.startswith("tcp://") and host in ("0.0.0.0", "::", "*"):
                    mine, _ = _split_tcp(self.endpoint)
                    events_endpoint = f"tcp://{mine}:{events_endpoint.rpartition(':')[2]}"
            sub = Subscription(self, events_endpoint, topics)
            self._subscriptions.append(sub)
            return sub


class Subscription:
    """Residency events from a server's PUB socket. `sync()` waits until the
    subscription is live (PUB drops messages for subscribers it does not know yet)."""

    def __init__(self, client, endpoint, topics):
        self._client = client
        self.endpoint = endpoint
        self._sock = client._context().socket(zmq.SUB)
        client._configure(self._sock)
        for topic in [*topics, P.SYNC_TOPIC]:
            self._sock.setsockopt(zmq.SUBSCRIBE, topic if isinstance(topic, bytes) else topic.encode())
        self._sock.connect(endpoint)

    def sync(self, timeout=5.0):
        token = secrets.token_hex(8)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._client.call("ping", sync=token)
            until = min(deadline, time.monotonic() + 0.1)
            while True:
                remaining = until - time.monotonic()
                if remaining <= 0 or not self._sock.poll(max(1, int(remaining * 1000))):
                    break
                topic, body = self._sock.recv_multipart()
                if topic == P.SYNC_TOPIC and P.loads(body) == token:
                    return self
        raise RequestTimeout(f"subscription to {self.endpoint} not live within {timeout:g}s")

    def recv(self, timeout=None):
        """The next event dict; RequestTimeout if none within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0, deadline - time.monotonic())
            if remaining is not None and not self._sock.poll(max(1, int(remaining * 1000))):
                raise RequestTimeout(f"no event from {self.endpoint} within {timeout:g}s")
            topic, body = self._sock.recv_multipart()
            if topic != P.SYNC_TOPIC:
                return P.loads(body)

    def __iter__(self):
        while True:
            yield self.recv()

    def close(self):
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
