"""The client of a `prefetchd serve` front: numpy arrays in, numpy arrays out.

    from prefetchd.serve import Client
    with Client("ipc://serve.sock") as c:
        (y,) = c.infer("m0", x, timeout=30)            # x: a numpy array
        fut = c.submit("m0", x)                        # a concurrent.futures.Future
        new_tokens = c.generate("lm", input_ids, max_new_tokens=16)

One DEALER socket on one I/O thread (prefetchd.control.ioloop) serves any number
of callers and outstanding requests: `submit` queues a request and wakes the
loop; the loop sends it with the arrays as frames (no copy), matches replies by
request id, and completes each future with the reply's outputs (read-only views
of the received frames) or the error the reply names (ServiceError with .code,
BusyError, RequestTimeout); an infer future that has its outputs has `.reply`, the
reply's result document (worker, batch_size, queue_seconds, seconds...). Every future completes: a reply, an error, its
timeout (RequestTimeout, saying whether a server was ever connected), ConnectionLost as
soon as the connection drops with it outstanding (the server died or dropped it: no
reply can come), or ShutdownError when the client closes; `cancel()` returns False (a
request sent is the server's to run).
"""
import collections
import concurrent.futures
import itertools
import secrets
import threading
import time

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..control import protocol as P
from ..control.codes import BadArguments, ConnectionLost, RequestTimeout, exception_for
from ..control.endpoints import resolve_endpoint
from ..control.ioloop import IOLoop
from ..errors import ShutdownError
from .wire import DEFAULT_MAX_TENSOR_BYTES, decode_arrays, encode_arrays

__all__ = ["Client"]


def _running_future():
    """A Future already running: `cancel()` returns False, as it must for a request that is
    sent (the server runs it anyway). A pending one could be cancelled, and the I/O loop then
    crashed setting its timeout (InvalidStateError), failing every other request."""
    future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    return future


class _Link:
    """The client socket's connection, as its monitor reports it (the I/O thread only)."""

    EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED

    def __init__(self):
        self.up = self.ever = False
        self.down_since = None

    def lost(self, event):
        """Apply a monitor event; True when it is the loss of a connection that was up."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.up = self.ever = True
            return False
        if event == zmq.EVENT_DISCONNECTED and self.up:
            self.up, self.down_since = False, time.monotonic()
            return True
        return False

    def why_unanswered(self):
        if not self.ever:
            return "; no server accepted the connection meanwhile (is one running at that endpoint?)"
        if not self.up:
            return f"; the connection has been down for {time.monotonic() - self.down_since:.1f}s"
        return ""


class Client:
    def __init__(self, endpoint, timeout=30.0, max_tensor_bytes=DEFAULT_MAX_TENSOR_BYTES):
        self.endpoint = resolve_endpoint(endpoint, "serve")
        self.timeout = timeout
        self.max_tensor_bytes = max_tensor_bytes
        self._counter = itertools.count(secrets.randbits(31))
        self._lock = threading.Lock()
        self._outbox = collections.deque()       # (rid, frames) to send
        self._pending = {}                       # rid -> (future, deadline); loop thread only
        self._futures = set()                    # every future not yet done, for close()
        self._sock = self._monitor = None
        self._link = _Link()
        self._closed = False
        self._loop = IOLoop(self, "prefetchd-serve-client", max_poll=0.5)
        self._loop.start(10)

    # -- calls (any thread)

    def submit(self, model, *arrays, timeout=None, hint=None):
        """A Future of the model's outputs (a list of numpy arrays) for these inputs."""
        return self._submit("infer", {"model": model, "hint": hint}, arrays, timeout)

    def infer(self, model, *arrays, timeout=None, hint=None):
        """The model's outputs for these inputs: a list of numpy arrays."""
        timeout = self.timeout if timeout is None else timeout
        return self.submit(model, *arrays, timeout=timeout, hint=hint).result(timeout + 5)

    def submit_generate(self, model, input_ids, max_new_tokens=16, timeout=None):
        f = self._submit("generate", {"model": model, "max_new_tokens": int(max_new_tokens)},
                         [input_ids], timeout)
        out = _running_future()

        def done(d):
            if d.exception() is not None:
                out.set_exception(d.exception())
            else:
                out.reply = d.reply
                out.set_result(d.result()[0])
        f.add_done_callback(done)
        return out

    def generate(self, model, input_ids, max_new_tokens=16, timeout=None):
        """The greedy new token ids, (batch, max_new_tokens) int64, for a (batch, prompt) int64 array."""
        timeout = self.timeout if timeout is None else timeout
        return self.submit_generate(model, input_ids, max_new_tokens, timeout).result(timeout + 5)

    def close(self, timeout=5.0):
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._loop.close(timeout)
        for f in list(self._futures):
            if not f.done():
                f.set_exception(ShutdownError("client closed"))
        self._futures.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _submit(self, op, args, arrays, timeout):
        timeout = self.timeout if timeout is None else timeout
        headers, buffers = encode_arrays(arrays)
        total = sum(memoryview(b).nbytes for b in buffers)
        if total > self.max_tensor_bytes:   # else: refused, or dropped unanswered, after the timeout
            raise BadArguments(f"{op}: the inputs are {total} bytes, over max_tensor_bytes "
                               f"{self.max_tensor_bytes} (the server's limit by default); send fewer rows")
        future = _running_future()
        rid = P.new_rid(next(self._counter))
        # The front gives up a little before we do, so a slow request is answered TIMEOUT.
        frames = P.encode_request(rid, op, dict(args, inputs=headers),
                                  max(0.001, timeout * 0.9 - 0.05), buffers)
        with self._lock:
            if self._closed:
                raise ShutdownError("client is closed")
            self._futures.add(future)
            self._outbox.append((rid, frames, future, time.monotonic() + timeout, timeout))
        future.add_done_callback(self._futures.discard)
        self._loop.wake()
        return future

    # -- LoopHandler (the I/O thread)

    def setup(self, ctx):
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.linger = 0
        self._sock.sndhwm = self._sock.rcvhwm = 10000
        self._monitor = self._sock.get_monitor_socket(_Link.EVENTS)
        self._sock.connect(self.endpoint)

    def poll_items(self):
        return [(self._sock, self._on_reply, False), (self._monitor, self._on_monitor, True)]

    def tick(self):
        while True:
            with self._lock:
                if not self._outbox:
                    break
                rid, frames, future, deadline, timeout = self._outbox.popleft()
            try:
                self._sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:
                future.set_exception(RequestTimeout(f"send to {self.endpoint} failed: {e}"))
                continue
            self._pending[rid] = (future, deadline, timeout)
        now = time.monotonic()
        for rid, (future, deadline, timeout) in list(self._pending.items()):
            if deadline <= now:
                del self._pending[rid]
                future.set_exception(RequestTimeout(
                    f"no reply from {self.endpoint} within {timeout:g}s{self._link.why_unanswered()}"))

    def poll_timeout(self):
        nearest = min((d for _, d, _ in self._pending.values()), default=None)
        return None if nearest is None else nearest - time.monotonic()

    def teardown(self):
        for future, _, _ in self._pending.values():
            future.set_exception(ShutdownError("client closed"))
        self._pending.clear()
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def release(self):
        pass

    def _on_monitor(self, frames):
        if not self._link.lost(parse_monitor_message(frames)["event"]):
            return
        # Replies that came before the loss are still queued (the loop takes at most 256
        # messages a round, and a burst of replies then the loss failed hundreds that had
        # come): answers, not losses. The rest were sent over that connection: their reply
        # cannot come now. (One sent just before the event may still sit in the socket's
        # queue and run on the next connection; its reply is then dropped: "may have run".)
        while True:
            try:
                self._on_reply(self._sock.recv_multipart(zmq.NOBLOCK, copy=False))
            except zmq.Again:
                break
        for future, _, _ in self._pending.values():
            future.set_exception(ConnectionLost(
                f"the connection to {self.endpoint} was lost with the request outstanding (the server "
                f"closed, died or dropped the connection): it may have run; no reply will come"))
        self._pending.clear()

    def _on_reply(self, frames):
        try:
            rid, doc, tensors = P.decode_reply(frames, tensors=True)
        except P.ProtocolError:
            return
        entry = self._pending.pop(rid, None)
        if entry is None:
            return                                   # timed out already
        future, _, timeout = entry
        if not doc.get("ok"):
            code, reason = doc.get("code", P.INTERNAL), doc.get("reason", "")
            if code == P.TIMEOUT:     # the server's share of it (see _submit) is what it names
                reason += f" (the client's timeout: {timeout:g}s, of which the server gets 90% less 50 ms)"
            future.set_exception(exception_for(code, reason))
            return
        result = doc.get("result") or {}
        try:
            outputs = decode_arrays(result.get("outputs", []), tensors, self.max_tensor_bytes,
                                    what="output")
        except ValueError as e:
            future.set_exception(e)
            return
        future.reply = result
        future.set_result(outputs)
