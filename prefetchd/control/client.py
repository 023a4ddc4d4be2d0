"""The control plane's client: a DEALER with per-call timeouts (Lazy Pirate) and
subscriptions to residency events.

    with Client("ipc://") as c:                    # ipc://$XDG_RUNTIME_DIR/prefetchd/default.sock
        c.prefetch(["layer.0.weight"], wait=True)
        lease = c.pin("layer.1.*", lease=30)       # expires unless renewed
        c.renew(lease)
        c.unpin(lease)
"""
import itertools
import os
import secrets
import threading
import time

import zmq

from ..errors import ShutdownError
from . import protocol as P
from .codes import RequestTimeout, exception_for
from .endpoints import is_ipv6, join_tcp, resolve_endpoint, split_tcp
from .keys import client_curve

__all__ = ["Client", "Subscription"]


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
        self._curve = (None if server_public_key is None
                       else client_curve(server_public_key, client_keys))
        self._lock = threading.RLock()
        self._ctx = None
        self._pid = None
        self._sock = None
        self._counter = itertools.count(secrets.randbits(31))
        self._closed = False
        self._subscriptions = []
        self.reconnects = 0          # sockets dropped after a timeout (Lazy Pirate)

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
            sock.ipv6 = is_ipv6(self.endpoint)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _reset(self):
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
            self.reconnects += 1

    @property
    def connected(self):
        """Whether the client holds a socket (it makes one on the next call if not)."""
        return self._sock is not None

    def subscription_socket(self):
        """A new SUB socket configured like the client's (CURVE, linger); the caller owns it."""
        with self._lock:
            sock = self._context().socket(zmq.SUB)
            self._configure(sock)
            return sock

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
                    raise RequestTimeout(f"{op}: no reply from {self.endpoint} within {timeout:g}s"
                                         f"{self._silence_hint(len(frames[2]))}")
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

    def _silence_hint(self, body_bytes):
        """What else than a slow daemon a request with no reply can mean."""
        hints = []
        if body_bytes > P.dropped_above(P.DEFAULT_MAX_MESSAGE_SIZE):
            hints.append(f"the request was {body_bytes} bytes, and a server drops one over 4x its "
                         f"max_message_size (default {P.DEFAULT_MAX_MESSAGE_SIZE} bytes) unanswered: "
                         f"name fewer tensors, or a pattern")
        if self.endpoint.startswith("tcp://") and self._curve is None:
            hints.append("over tcp, a server with CURVE keys ignores a client without them "
                         "(server_public_key=, or --curve-dir), as does a port nothing listens on")
        return "; " + "; ".join(hints) if hints else ""

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
                    mine, _ = split_tcp(self.endpoint)
                    events_endpoint = join_tcp(mine, events_endpoint.rpartition(':')[2])
            sub = Subscription(self, events_endpoint, topics)
            self._subscriptions.append(sub)
            return sub


class Subscription:
    """Residency events from a server's PUB socket. `sync()` waits until the
    subscription is live (PUB drops messages for subscribers it does not know yet)."""

    def __init__(self, client, endpoint, topics):
        self._client = client
        self.endpoint = endpoint
        self._sock = client.subscription_socket()
        for topic in [*topics, P.SYNC_TOPIC]:
            self._sock.setsockopt(zmq.SUBSCRIBE, topic if isinstance(topic, bytes) else topic.encode())
        self._sock.ipv6 = is_ipv6(endpoint)
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
