"""The daemon's ZeroMQ server: a ROUTER for requests, a PUB for residency events,
both owned by one IOLoop thread.

Daemon futures finish on the scheduler thread; their callbacks only append to a
deque and wake the loop, which sends the reply. Nothing the loop calls blocks:
requests that wait for the daemon are parked and answered when their future
completes or their deadline passes. Operations: prefetchd.control.ops.

Security: ipc sockets live in a private directory and are bound with umask 0177;
tcp binds loopback unless `allow_remote`, and `allow_remote` needs CURVE keys
(`curve_keys_dir`, made by `prefetchd keys DIR`) unless `allow_insecure_remote`;
with CURVE every peer must present an authorized key, and one that does not is
never answered.
"""
import collections
import heapq
import itertools
import logging
import time
from dataclasses import dataclass

import zmq

from ..errors import ShutdownError
from . import keys, protocol as P, server_options
from .codes import BadArguments, error_code
from .borrowed import source_fd
from .connections import (DEFAULT_FD_RESERVE, DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_PER_PEER,
                          IDLE_EVICT_AFTER)
from .event_feed import EventFeed
from .guarded import GuardedListening
from .ioloop import IOLoop
from .leases import LeaseTable
from .ops import OPS, Deferred
from .router import RouterEndpoint

log = logging.getLogger("prefetchd.control.server")


@dataclass
class Pending:
    """A parked request: answered when its future completes or at `deadline`."""
    envelope: list
    rid: bytes
    op: str
    deadline: float
    wait: float
    on_result: object          # (result, pending) -> reply payload, on the I/O thread
    on_abandon: object = None  # runs if the future succeeds after nobody waits for it
    lease: str | None = None
    fd: int | None = None      # its connection's descriptor: busy, not idle, until answered


class Server(RouterEndpoint):
    """Serves one daemon (a prefetchd.control.served.ServedDaemon) on `endpoint`.
    `start()` returns self; `close()` is bounded.

    Keyword options (all optional; defaults from the daemon's config when it has them):
      events_endpoint   where the PUB socket binds (default: next to the ROUTER)
      max_message_size  bytes of a request body (1 MiB); larger bodies get TOO_LARGE,
                        frames beyond 4x are cut off by zmq (MAXMSGSIZE) unanswered
      max_outstanding   requests waiting on the daemon before BUSY (1024; 256 per client)
      hwm               send/receive high-water marks of every socket (1000)
      max_wait          seconds a parked request may wait before TIMEOUT (600)
      default_lease     seconds of a pin lease when the client gives none (30; max 3600)
      curve_keys_dir    require CURVE: server.key_secret + authorized_clients/*.key
      allow_remote      allow binding tcp on a non-loopback address (needs curve_keys_dir)
      allow_insecure_remote  allow_remote without CURVE: anyone who can reach the port
                        controls the daemon
      max_connections   connections held at once by the ROUTER and PUB sockets (512); the
                        excess is dropped (prefetchd.control.connections)
      max_connections_per_peer  from one process (ipc) or address (tcp) (64); at either
                        budget, a ROUTER connection idle IDLE_EVICT_AFTER seconds with no
                        request unanswered gives way to a new one (subscribers never do)
      fd_reserve        descriptors below RLIMIT_NOFILE kept for the store (64)

    The server implements prefetchd.control.ioloop.LoopHandler: setup/poll_items/
    tick/poll_timeout/teardown/release are called by its IOLoop only.
    """

    def __init__(self, daemon, endpoint, *, events_endpoint=None, max_message_size=None,
                 max_outstanding=1024, max_outstanding_per_client=256, hwm=1000,
                 max_wait=600.0, default_lease=30.0, max_lease=3600.0, curve_keys_dir=None,
                 allow_remote=False, allow_insecure_remote=False, name=None,
                 max_connections=DEFAULT_MAX_CONNECTIONS, max_connections_per_peer=DEFAULT_MAX_PER_PEER,
                 fd_reserve=DEFAULT_FD_RESERVE):
        options = server_options.resolve(
            daemon, endpoint, events_endpoint=events_endpoint, max_message_size=max_message_size,
            curve_keys_dir=curve_keys_dir, allow_remote=allow_remote,
            allow_insecure_remote=allow_insecure_remote, name=name)
        super().__init__(options.max_message_size)
        self.daemon = daemon
        self.name = options.name
        self.curve_keys_dir = options.curve_keys_dir
        self.endpoint, self.events_endpoint = options.endpoint, options.events_endpoint
        self.max_outstanding = max_outstanding
        self.max_outstanding_per_client = max_outstanding_per_client
        self.hwm = hwm
        self.max_wait = max_wait
        self.default_lease = default_lease
        self.max_lease = max_lease
        self.connections = GuardedListening(self._bind, lambda: [(self._router, self.endpoint),
                                                                 (self._pub, self.events_endpoint)],
                                            max_connections, max_connections_per_peer, fd_reserve,
                                            idle_after=IDLE_EVICT_AFTER, busy=self._busy_fds)
        self.leases = LeaseTable(daemon.unpin, self.counters)
        self._loop = IOLoop(self, f"prefetchd-server-{self.name}")
        self._auth = self._authorized = None
        # Hand-off from other threads (appends are atomic); the loop drains them in tick().
        self._completions = collections.deque()
        self._events = EventFeed(self.counters, self._loop.wake, self.name)
        # Owned by the I/O thread only.
        self._pending = {}
        self._abandoned = {}        # token -> cleanup of a timed-out request still running
        self._per_client = collections.Counter()
        self._timers = []           # heap of (deadline, token)
        self._tokens = itertools.count()
        self._pub = None

    # -- lifecycle (caller's thread)

    def start(self, timeout=10.0):
        if self._loop.running:
            return self
        self._loop.start(timeout)
        add_listener = getattr(self.daemon, "add_listener", None)
        if add_listener is not None:
            add_listener(self._events.on_event)
        log.info("prefetchd server %s listening on %s (events %s)", self.name, self.endpoint,
                 self.events_endpoint)
        return self

    def close(self, timeout=None):
        """Stop serving; returns within `timeout` seconds (default 5) even if the I/O thread is stuck."""
        if self._loop.closed:
            return
        remove = getattr(self.daemon, "remove_listener", None)
        if remove is not None:
            try:
                remove(self._events.on_event)
            except Exception:  # noqa: BLE001 - the daemon may be half-closed already
                pass
        self._loop.close(5.0 if timeout is None else timeout)

    @property
    def running(self):
        return self._loop.running

    @property
    def closed(self):
        """True once close() has released the sockets and the ZeroMQ context."""
        return self._loop.closed

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # -- hand-off from other threads (scheduler, listeners)

    def _on_done(self, token, future):
        self._completions.append((token, future))
        self._loop.wake()

    # -- LoopHandler (I/O thread)

    def setup(self, ctx):
        curve = None
        if self.curve_keys_dir:
            self._auth, curve, self._authorized = keys.start_authenticator(ctx, self.curve_keys_dir)
        self._router = self._make_socket(ctx, zmq.ROUTER, hwm=self.hwm, curve=curve)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.maxmsgsize = P.dropped_above(self.max_message_size)
        self.connections.watch(self._router, curve is not None)   # before bind: no connection goes unseen
        self._bind(self._router, self.endpoint)
        self.endpoint = self._router.last_endpoint.decode()
        self._pub = self._make_socket(ctx, zmq.PUB, hwm=self.hwm, curve=curve)
        self.connections.watch(self._pub, curve is not None, idle=False)
        self._bind(self._pub, self.events_endpoint)
        self.events_endpoint = self._pub.last_endpoint.decode()

    def poll_items(self):
        # Frames (no copy): _handle reads which connection sent them (SRCFD), and with
        # CURVE whose key (User-Id).
        return [(self._router, self._handle, False)] + self.connections.poll_items()

    def tick(self):
        self.connections.tick()
        self._drain_completions()
        self._events.publish(self._pub)
        self._run_timers()

    def poll_timeout(self):
        if self._completions or self._events:
            return 0.0
        nearest = min([t[0] for t in self._timers[:1]]
                      + [t for t in [self.leases.next_expiry(), self.connections.wake_at] if t is not None],
                      default=None)
        return None if nearest is None else nearest - time.monotonic()

    def teardown(self):
        self.leases.release_all()
        for pending in self._pending.values():
            self._send(pending.envelope, P.encode_error(pending.rid, P.SHUTDOWN, "server closing"))
        self._pending.clear()
        self.connections.close()
        self._close_sockets(self._router, self._pub)
        self._router = self._pub = None

    def release(self):
        if self._auth is not None:
            self._auth.stop()
            self._auth = self._authorized = None

    # -- what ops call (I/O thread)

    def publish_sync(self, token):
        """Publish a subscription-sync token (see Subscription.sync)."""
        try:
            self._pub.send_multipart([P.SYNC_TOPIC, P.dumps(token)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def server_status(self):
        c = self.counters
        return {"endpoint": self.endpoint, "events": self.events_endpoint,
                "outstanding": len(self._pending), "max_outstanding": self.max_outstanding,
                "leases": len(self.leases), "curve": bool(self.curve_keys_dir),
                "busy": c.busy, "malformed": c.malformed, "timeouts": c.timeouts,
                "requests_revoked": c.revoked,
                "replies_unroutable": c.replies_unroutable, "replies_dropped": c.replies_dropped,
                "events_published": c.events_published, "events_dropped": c.events_dropped,
                "leases_granted": c.leases_granted, "leases_expired": c.leases_expired,
                "leases_released": c.leases_released, **self.connections.counts(),
                "requests": dict(c.requests), "errors": dict(c.errors)}

    # -- requests

    def _busy_fds(self):
        """Descriptors of the connections with a request not yet answered."""
        return {pending.fd for pending in self._pending.values()}

    def _handle(self, frames):
        fd = source_fd(frames[0])
        if self._authorized is not None and not self._authorized.allows(frames[0].get("User-Id")):
            # Its key left authorized_clients since it connected: never answered, and
            # its connection shut down (a reconnect meets ZAP, which refuses it).
            self.counters.revoked += 1
            if fd is not None:
                self.connections.shut(fd)
            return
        if fd is None or not self.connections.saw(fd):
            return               # its connection closed, or dropped by the guard: nobody to answer
        frames = [f.bytes for f in frames]
        envelope, payload = P.split_envelope(frames)
        total = sum(len(f) for f in payload)
        if total > self.max_message_size + 64 and payload and payload[0] == P.MAGIC:
            rid = payload[1] if len(payload) > 1 and len(payload[1]) == P.RID_SIZE else P.NO_RID
            self.counters.malformed += 1
            self._reply_error(envelope, rid, P.TOO_LARGE, f"message of {total} bytes exceeds the limit "
                              f"of {self.max_message_size} bytes")
            return
        request = self._decode(envelope, payload)
        if request is None:
            return
        rid, op, args, timeout = request
        spec = OPS.get(op)
        self.counters.requests[op if spec else "?"] += 1
        if spec is None:
            self._reply_error(envelope, rid, P.BAD_REQUEST,
                              f"unknown op {op[:64]!r}; known: {', '.join(sorted(OPS))}")
            return
        owner = envelope[0]
        if len(self._pending) >= self.max_outstanding or (
                self._per_client[owner] >= self.max_outstanding_per_client):
            self.counters.busy += 1
            self._reply_error(envelope, rid, P.BUSY,
                              f"{len(self._pending)} requests outstanding; retry later")
            return
        try:
            outcome = spec.handler(self, spec.validate(args, op), owner)
        except BadArguments as e:
            self._reply_error(envelope, rid, P.BAD_REQUEST, f"{op}: {e}")
            return
        except Exception as e:  # noqa: BLE001 - every request gets an answer
            code = error_code(e)
            if code == P.INTERNAL:
                log.exception("prefetchd server: %s failed", op)
            self._reply_error(envelope, rid, code, f"{op}: {e}")
            return
        if isinstance(outcome, Deferred):
            self._park(envelope, rid, op, timeout, outcome, fd)
        else:
            self._reply_ok(envelope, rid, outcome)

    def _park(self, envelope, rid, op, timeout, deferred, fd):
        token = next(self._tokens)
        wait = min(timeout or self.max_wait, self.max_wait)
        deadline = time.monotonic() + wait
        self._pending[token] = Pending(envelope, rid, op, deadline, wait, deferred.on_result,
                                       deferred.on_abandon, fd=fd)
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
                self.leases.release(pending.lease)   # the client is gone

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
        self.leases.expire(now)
