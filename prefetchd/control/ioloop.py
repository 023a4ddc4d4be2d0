"""One I/O thread that owns a set of ZeroMQ sockets: the loop shared by the
control Server and the `prefetchd serve` front.

Every socket is created, used and closed on the loop's thread. Other threads
talk to it only through `wake()` (one inproc message in flight at most: the
handler's own deques carry the data) and `close()`. The loop:

    start()   spawn the thread; it binds an inproc wake socket and runs
              handler.setup(ctx); start() re-raises a setup error in the caller
    loop      poll the handler's sockets and file descriptors plus the wake
              socket, hand each ready socket's messages (at most 256 per round,
              so timers and hand-offs keep running) to its callback, then
              handler.tick(); the poll waits at most handler.poll_timeout()
    close()   bounded: ask the thread to stop, wait until the deadline, then
              destroy the context; a thread stuck in a handler call is left
              to destroy it itself when it returns (never a hang in close)

The handler (see LoopHandler) answers outstanding work and closes its sockets in
teardown(), which runs on the loop's thread after the loop or a failed setup.
"""
import logging
import math
import threading
import time
from typing import Protocol

import zmq

log = logging.getLogger("prefetchd.control.ioloop")

WAKE = b"w"
STOP = b"stop"
MAX_BATCH = 256


class LoopHandler(Protocol):
    """What an IOLoop runs. Every method runs on the loop's thread except release()."""

    def setup(self, ctx: zmq.Context) -> None:
        """Create and bind sockets; an exception fails start()."""

    def poll_items(self) -> list:
        """[(zmq socket, on_frames(frames)), (zmq socket, on_frames, copy) or
        (fd, on_ready())] to poll this round; copy=False hands on_frames zmq.Frames
        (no copy: tensors are viewed in place)."""

    def tick(self) -> None:
        """Runs after every poll: drain hand-offs, dispatch, run timers."""

    def poll_timeout(self) -> float | None:
        """Seconds the next poll may wait (None: nothing scheduled)."""

    def teardown(self) -> None:
        """Answer what is outstanding and close every socket (also after a failed setup)."""

    def release(self) -> None:
        """Free what outlives the sockets (e.g. an authenticator); runs once, just
        before the context is destroyed, on whichever thread destroys it."""


class IOLoop:
    """Runs a LoopHandler on a thread named `thread_name` (see the module docstring)."""

    def __init__(self, handler, thread_name, max_poll=1.0):
        self.handler = handler
        self.thread_name = thread_name
        self.max_poll = max_poll
        self._ctx = None
        self._thread = None
        self._ident = None
        self._started = threading.Event()
        self._start_error = None
        self._stop = False
        self._address = f"inproc://prefetchd-loop-{id(self):x}"
        self._wake_lock = threading.Lock()
        self._wake_sock = None          # PUSH, used by other threads under _wake_lock
        self._wake_sent = False
        self._state_lock = threading.Lock()
        self._closed = False
        self._done = False              # the thread has left the loop and closed its sockets
        self._orphaned = False          # close() gave up waiting; the thread finalizes

    # -- caller's thread

    @property
    def context(self):
        """The loop's zmq.Context (None before start() and after close())."""
        return self._ctx

    @property
    def running(self):
        return self._thread is not None and self._thread.is_alive()

    @property
    def closed(self):
        """True once close() has run and the context is destroyed (or will be, by a stuck thread)."""
        return self._closed and self._ctx is None

    def start(self, timeout=10.0):
        """Start the thread and wait until handler.setup() returned; re-raises its error."""
        if self._thread is not None:
            return self
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            self.close(1.0)
            raise RuntimeError(f"{self.thread_name} did not start within {timeout:g}s")
        if self._start_error is not None:
            self._thread.join(1.0)
            self._finalize()
            self._closed = True
            raise self._start_error
        wake = self._ctx.socket(zmq.PUSH)
        wake.linger = 0
        wake.sndhwm = 16
        wake.connect(self._address)
        with self._wake_lock:
            self._wake_sock = wake
        return self

    def wake(self):
        """Make the loop run tick() soon; cheap, never blocks, callable from any thread."""
        if threading.get_ident() == self._ident:
            return            # the loop ticks before it polls again
        with self._wake_lock:
            if self._wake_sent or self._wake_sock is None:
                return
            try:
                self._wake_sock.send(WAKE, zmq.NOBLOCK)
                self._wake_sent = True
            except zmq.ZMQError:
                pass          # a wake is already queued

    def close(self, timeout=5.0):
        """Stop the loop; returns within `timeout` seconds even if the thread is stuck.
        Returns True if the thread stopped (False: it finalizes when it returns)."""
        with self._state_lock:
            if self._closed or self._thread is None:
                self._closed = True
                return True
            self._closed = True
        deadline = time.monotonic() + max(0.0, timeout)
        self._stop = True                 # seen within a poll interval even without the message
        with self._wake_lock:
            if self._wake_sock is not None:
                try:
                    self._wake_sock.send(STOP, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._wake_lock:
            if self._wake_sock is not None:
                self._wake_sock.close(linger=0)
                self._wake_sock = None
        with self._state_lock:
            if not self._done:
                self._orphaned = True
                log.warning("%s did not stop within %.1fs; it cleans up when it returns",
                            self.thread_name, timeout)
                return False
        self._finalize()
        return True

    def _finalize(self):
        try:
            self.handler.release()
        except Exception:  # noqa: BLE001 - closing must finish
            log.debug("%s: release failed", self.thread_name, exc_info=True)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # -- the loop's thread

    def _run(self):
        self._ident = threading.get_ident()
        ctl = None
        try:
            ctl = self._ctx.socket(zmq.PULL)
            ctl.linger = 0
            ctl.bind(self._address)
            self.handler.setup(self._ctx)
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._start_error = e
            self._shut(ctl)
            self._started.set()
            return
        self._started.set()
        try:
            self._loop(ctl)
        except Exception:  # noqa: BLE001
            log.exception("%s: I/O loop crashed; no longer serving", self.thread_name)
        finally:
            self._shut(ctl)
            with self._state_lock:
                orphaned = self._orphaned
            if orphaned:
                self._finalize()

    def _shut(self, ctl):
        try:
            self.handler.teardown()
        except Exception:  # noqa: BLE001
            log.exception("%s: teardown failed", self.thread_name)
        if ctl is not None:
            ctl.close(linger=0)
        with self._state_lock:
            self._done = True

    def _loop(self, ctl):
        handler = self.handler
        while not self._stop:
            poller = zmq.Poller()          # rebuilt each round: the handler's sockets may change
            poller.register(ctl, zmq.POLLIN)
            items = handler.poll_items()
            for item, *_ in items:
                poller.register(item, zmq.POLLIN)
            ready = dict(poller.poll(self._timeout_ms()))
            if ready.get(ctl) and self._drain_wake(ctl):
                return
            for item, callback, *copy in items:
                if not ready.get(item):
                    continue
                if isinstance(item, zmq.Socket):
                    self._drain(item, callback, copy[0] if copy else True)
                else:
                    self._guard(callback)
            handler.tick()

    def _timeout_ms(self):
        wait = self.handler.poll_timeout()
        wait = self.max_poll if wait is None else min(self.max_poll, max(0.0, wait))
        return math.ceil(wait * 1000)

    def _drain_wake(self, ctl):
        stop = False
        while True:
            try:
                stop = ctl.recv(zmq.NOBLOCK) == STOP or stop
            except zmq.Again:
                break
        with self._wake_lock:
            self._wake_sent = False
        return stop

    def _drain(self, sock, on_frames, copy=True):
        for _ in range(MAX_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=copy)
            except zmq.Again:
                return
            self._guard(on_frames, frames)

    def _guard(self, fn, *args):
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - one bad message must not stop the loop
            log.exception("%s: handling a message failed", self.thread_name)
