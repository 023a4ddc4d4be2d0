"""The front's lifecycle and sockets: start the I/O loop and the workers, wait
until they are ready, bind and close the sockets, stop everything within a
timeout, and remove what the front made (ipc files, a temporary store). What
the front does with its sockets is prefetchd.serve.front.Front, a subclass.
"""
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import threading
import time

import zmq

from ..config import Config, ConfigError
from ..errors import ShutdownError
from ..control import protocol as P
from ..control.connections import DEFAULT_MAX_CONNECTIONS, IDLE_EVICT_AFTER
from ..control.borrowed import source_fd
from ..control.endpoints import resolve_endpoint, runtime_dir

from ..control.guarded import GuardedListening
from ..control.router import RouterEndpoint
from ..socket_dirs import ensure_private_dir
from ..telemetry.metrics_server import check_listenable
from ..staging.generations import lock_or_holder, read_index
from .leftovers import remove_dead_worker_stores, remove_leftovers
from .spec import check_checkpoint_store
from .worker import STOP

log = logging.getLogger("prefetchd.serve.front")

SERVE_LOCK = ".prefetchd-serve.lock"      # in --store, held by the front for its life

# The front authenticates no one (no CURVE), so allow_remote does not apply to it.
FRONT_REMOTE_HINT = ("the serve front has no CURVE authentication, so it listens on ipc:// or "
                     "loopback tcp:// only; reach it from another host through an authenticated "
                     "tunnel (ssh -L, a TLS proxy)")


def hold_store(store_dir):
    """An exclusive flock on `store_dir`'s serve lock, with this pid in it; ConfigError naming
    the holder if another front has it. Worker stores are named by index and generation
    (`worker-0-1`), so a second server on the same --store took the first one's names, and
    removed a directory the first one's worker was reading."""
    path = os.path.join(store_dir, SERVE_LOCK)
    while True:
        try:
            os.makedirs(store_dir, mode=0o700, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise ConfigError(f"--store {store_dir}: cannot use it: {e.strerror}") from None
        try:
            holder = lock_or_holder(fd)
        except OSError as e:       # writing our pid into it: a full or read-only filesystem
            os.close(fd)
            raise ConfigError(f"--store {store_dir}: cannot write its lock file {path}: {e.strerror}") from None
        if holder is not None:
            raise ConfigError(f"--store {store_dir}: in use by another prefetchd serve (pid {holder}); "
                              f"give each server a --store of its own")
        # A front that stops unlinks its lock file (release_store); one opened just before
        # that is no lock any more: take the file now at the path.
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def release_store(store_dir, fd):
    """Give up hold_store's lock on `store_dir` and remove its file (while still holding it)."""
    try:
        os.unlink(os.path.join(store_dir, SERVE_LOCK))
    except OSError:
        pass
    os.close(fd)


class FrontSockets(RouterEndpoint):
    send_copy = False             # replies carry output tensors: hand zmq the frames, no copy

    def __init__(self, endpoint, name, spec, metrics_port, metrics_addr, start_timeout,
                 max_message_size, max_connections=DEFAULT_MAX_CONNECTIONS, busy=None):
        super().__init__(max_message_size)
        self.spec = spec
        self.name = name
        self.endpoint = resolve_endpoint(endpoint or f"ipc://{name}.sock", name, bind=True,
                                         remote_hint=FRONT_REMOTE_HINT)
        self.metrics_port, self.metrics_addr = metrics_port, metrics_addr
        self.start_timeout = start_timeout
        self.stop_timeout = max(10.0, Config.load(spec.config_path).shutdown_timeout + 5.0)
        self._exporter = None
        self._owns_store = spec.store_dir is None    # a temporary one, made by start()
        if spec.checkpoint_store:     # refused here, not by every worker as it starts
            check_checkpoint_store(spec, spec.store_dir)
            self.spec = spec = dataclasses.replace(
                spec, checkpoint_generation=read_index(spec.checkpoint_store).get("generation"))
        tag = f"{os.getpid()}-{secrets.token_hex(2)}"
        base = runtime_dir()
        self._control_endpoint = lambda i: f"ipc://{os.path.join(base, f'{name}-{tag}-w{i}.sock')}"
        self._work_endpoint = f"ipc://{os.path.join(base, f'{name}-{tag}-work.sock')}"
        self._work = None
        self._ready_event = threading.Event()
        self._stopping = threading.Event()   # set once the loop answered what was outstanding (close)
        self._start_error = None
        self._closed = False
        self._shared = None           # (owner, its store) of the shared host tier, with --shared-host
        self._store_lock = None       # hold_store's descriptor while started
        self._made_store = False      # start() made the --store directory (removed by close())
        self._tag = f"{name}-{tag}"
        # The clients' socket takes connections from anyone who can reach it: bounded
        # like the daemon's server (prefetchd.control.connections), so a flood of them
        # cannot run the front out of descriptors (libzmq aborts there). No budget per
        # peer below the total: one gateway process may hold a client per thread. Idle
        # connections (busy() -> those with a request unanswered are not) give way to new
        # ones there, so one process holding them all cannot lock the others out.
        self.connections = GuardedListening(self._bind, lambda: [(self._router, self.endpoint)],
                                            max_connections, max_connections,
                                            idle_after=IDLE_EVICT_AFTER, busy=busy)

    # -- lifecycle

    def start(self, wait_ready=True, stop=None):
        """Start the loop and the workers; with wait_ready, return once they are ready.
        stop: an Event that, set while waiting (a signal), closes everything and raises
        ShutdownError instead of waiting out start_timeout."""
        if self._loop.running:
            return self
        if self.metrics_port:   # a busy port failed the start only once every worker was up
            check_listenable(self.metrics_addr, self.metrics_port)
        ensure_private_dir(runtime_dir())
        remove_leftovers(self.spec.checkpoint_store, runtime_dir(), SERVE_LOCK)   # of killed fronts
        if self._owns_store:
            self.spec = self.spec.with_temporary_store()
            self._pool.spec = self.spec
        self._made_store = self._owns_store or not os.path.exists(self.spec.store_dir)
        try:
            self._store_lock = hold_store(self.spec.store_dir)
        except BaseException:
            if self._owns_store:
                shutil.rmtree(self.spec.store_dir, ignore_errors=True)
            raise
        if not self._owns_store:
            remove_dead_worker_stores(self.spec.store_dir)     # of a front killed with SIGKILL
        try:
            if self.spec.shared_host:
                from ..sharedhost.serving import start_owner
                from .worker import link_checkpoint_store
                self._shared = start_owner(self.spec, runtime_dir(), self._tag, link_checkpoint_store)
                self.spec = self._pool.spec = dataclasses.replace(self.spec, shared_socket=self._shared[0].path)
            self._loop.start(30)
        except BaseException:
            self._stop_shared()
            self._release_store()
            raise
        if wait_ready:
            self._await_ready(stop)
        return self

    def _await_ready(self, stop):
        deadline = time.monotonic() + self.start_timeout
        while not self._ready_event.wait(0.25):
            if stop is not None and stop.is_set():
                self.close(10)
                raise ShutdownError("prefetchd serve: stopped while its workers were starting")
            if time.monotonic() >= deadline:
                self.close(10)
                raise TimeoutError(f"prefetchd serve: workers not ready within {self.start_timeout:g}s "
                                   f"(--start-timeout)")
        if self._start_error is not None:
            self.close(10)
            raise self._start_error
        if self.metrics_port is not None:
            from .metrics import start_front_exporter
            try:
                self._exporter = start_front_exporter(self, self.metrics_addr, self.metrics_port)
            except BaseException:
                # A busy port: stop the workers, remove the sockets, the lock and the worker
                # stores (all were left, and a client of the dead front's socket waited out
                # its timeout).
                self.close(10)
                raise
            self.metrics_port = self._exporter.port
        log.info("prefetchd serve: %d of %d workers ready; front on %s",
                 sum(s.ready for s in self._pool.slots), self.n_workers, self.endpoint)

    def close(self, timeout=None):
        """Stop within `timeout` (a few seconds more if the workers must be killed): what is
        outstanding is answered SHUTDOWN, and so is every request that comes while the
        workers stop (the clients' socket was closed first: those went unanswered).
        None: `stop_timeout`, the workers' configured shutdown_timeout and 5 s more, at
        least 10 s (a fixed 10 s killed workers a longer shutdown_timeout let write back)."""
        if self._closed:
            return
        self._closed = True
        timeout = self.stop_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if self._exporter is not None:
            self._exporter.close(1.0)
        if self._loop.running:        # the loop answers and stops the workers (tick), then only refuses
            self._loop.wake()
            self._stopping.wait(min(1.0, timeout))
        self._pool.stop(deadline)
        self._loop.close(max(1.0, deadline - time.monotonic()))
        self._stop_shared()
        self._release_store()

    def _release_store(self):
        if self._owns_store:
            shutil.rmtree(self.spec.store_dir, ignore_errors=True)
        if self._store_lock is not None:
            if not self._owns_store:
                release_store(self.spec.store_dir, self._store_lock)
                if self._made_store:        # made by start(): removed if nothing else is there
                    try:
                        os.rmdir(self.spec.store_dir)
                    except OSError:
                        pass
            else:
                os.close(self._store_lock)
            self._store_lock = None

    def _stop_shared(self):
        if self._shared is not None:
            from ..sharedhost.serving import stop_owner
            stop_owner(*self._shared)
            self._shared = None

    def shared_status(self):
        """The shared host tier's status (prefetchd.sharedhost), or None without one."""
        return self._shared[0].status() if self._shared is not None else None

    def serve_forever(self, stop=None, on_ready=None):
        """Run until SIGINT/SIGTERM (for the CLI), or until `stop` (an Event the caller's own
        signal handlers set) is set. Raises RuntimeError once no worker is left that could
        serve (each failed to start again MAX_START_FAILURES times, or respawn is off): a
        supervisor (systemd, Kubernetes) then sees the failure and restarts the server."""
        if stop is None:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
        try:
            self.start(stop=stop)
        except ShutdownError:
            log.info("prefetchd serve: stopped by a signal before its workers were ready")
            return
        if on_ready is not None:
            on_ready(self)           # the endpoint and metrics port bound (a port 0 is known now)
        try:        # (a _start_error set while serving: every worker gave up; see Front._on_death)
            while not stop.wait(0.5) and self._loop.running and self._start_error is None:
                pass
        finally:
            self.close()
        if self._start_error is not None:    # a server with no worker left: say why and exit 1
            raise self._start_error

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def workers(self):
        """[(index, pid, ready)] — a snapshot for tests and the CLI."""
        return [(s.index, s.pid, s.ready) for s in self._pool.slots]

    @property
    def socket_files(self):
        """The ipc socket files the front bound (removed by close())."""
        return [self.endpoint[len("ipc://"):], self._pool.work_endpoint[len("ipc://"):]]

    @property
    def running(self):
        return self._loop.running

    # -- LoopHandler: setup, poll_items, tick, teardown, release (I/O thread)

    def setup(self, ctx):
        self._router = self._make_socket(ctx, zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Per frame: a body within max_message_size, a tensor within max_tensor_bytes.
        self._router.maxmsgsize = max(P.dropped_above(self.max_message_size), self.spec.max_tensor_bytes + 64)
        self.connections.watch(self._router)          # before bind: no connection goes unseen
        self._bind(self._router, self.endpoint)
        self.endpoint = self._router.last_endpoint.decode()
        self._work = self._make_socket(ctx, zmq.ROUTER)
        self._work.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._bind(self._work, self._pool.work_endpoint)
        self._pool.start(ctx)

    def poll_items(self):
        """Once close() began, only the clients' socket (and the guard's monitors): close()
        waits for the workers on its own thread meanwhile, so nothing here touches them."""
        if not self._closed:
            return self._serving_items()
        return [(self._router, self._refuse_closing, False)] + self.connections.poll_items()

    def tick(self):
        if not self._closed:
            return self._serving_tick()
        self._stop_serving()
        self.connections.tick()

    def _received(self, frames):
        """(envelope, (rid, op, args, timeout) or None, tensor frames) of a client's request;
        None once a malformed one was answered, or if its connection was dropped or closed."""
        n = 2 if len(frames) >= 2 and len(frames[1]) == 0 else 1
        envelope = [f.bytes for f in frames[:n]]
        head, tensors = [f.bytes for f in frames[n:n + 3]], frames[n + 3:]
        fd = self._request_fd = source_fd(frames[0])     # for a Job (its connection is then busy)
        request = self._decode(envelope, head) if fd is not None and self.connections.saw(fd) else None
        return envelope, request, tensors

    def _refuse_closing(self, frames):
        envelope, request, _ = self._received(frames)
        if request is not None:
            self._reply_error(envelope, request[0], P.SHUTDOWN, "server closing")

    def _stop_serving(self):
        """Once: answer every outstanding job SHUTDOWN and tell the ready workers to stop."""
        if self._stopping.is_set():
            return
        for job in self.outstanding_jobs():
            self._fail(job, P.SHUTDOWN, "server closing")
        for s in self._pool.slots:
            if s.ready and self._work is not None:
                try:
                    self._work.send_multipart([s.identity, STOP], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self._stopping.set()

    def teardown(self):
        self._stop_serving()
        self.connections.close()
        self._close_sockets(self._router, self._work)
        self._router = self._work = None
        self._pool.close_sockets()

    def release(self):
        pass
