"""The Daemon: prefetchd's public API and composition root.

Any thread submits requests (prefetch, evict, pin, unpin, flush, watermarks,
register); they enter one queue and return futures. One scheduler thread
(prefetchd/core/scheduler.py) is the only one that changes residency state.
This module checks what callers hand in, builds the core from a Config, and
attaches what the config asks for (metrics exporter, control-plane server):
the core never imports those. The contract is docs/daemon-api.md; the
invariants it keeps are in docs/design.md.
"""
import atexit
import contextlib
import logging
import os
import threading
import time
import weakref

from . import backend as backends
from .backend import framework
from .config import PAGE, Config, parse_fraction_or_size
from .core import policy as policies, traces
from .core.binding import Binding
from .attachments import Attachments
from .core.events import Events
from .core.homes import HomeSpace
from .core.registering import Registrar, checked_name
from .core.registry import Registry, check_name
from .sigint import keep_keyboard_interrupt
from .core.requests import DONE, Kind, Request, check_deadline, check_priority
from .core.waits import RequestFuture, refuse_wait_on_scheduler
from .core.scheduler import Scheduler, run
from .core.session import ComputeSession
from .core.status import describe, describe_tensors
from .errors import ShutdownError
from .handle import TensorHandle
from .telemetry.stats import Stats
from .telemetry.timeline import Timeline

log = logging.getLogger("prefetchd")

live_daemons = weakref.WeakSet()   # started, not yet closed: what prefetchd.tier() consults


def _refusal(daemon):
    """Why `daemon` takes no more requests: closed, or it is a forked child's copy."""
    if daemon._state == "forked":
        return (f"prefetchd daemon {daemon.config.name!r} belongs to process {daemon._forked_from}; this "
                f"process is a fork of it, where its scheduler thread does not run, so every call would "
                f"wait for good. Start a Daemon in the child instead, and run MindSpore in processes "
                f"started with the 'spawn' method (MindSpore does not compute in a forked child either)")
    return (f"prefetchd daemon {daemon.config.name!r} is closed: cannot schedule new "
            f"requests after close() (a model offloaded to it cannot run any more)")


def _forked_child():
    """os.fork() copied the daemons but not their threads: a call that waits for the
    scheduler would wait for good (flush, prefetch().result(), use, handle.close()). The
    copies refuse every request from now on, are left out of the at-exit close and the
    dropped-daemon finalizer (both wait for that thread, and locks held at the fork), and
    get fresh locks of their own."""
    for daemon in list(live_daemons):
        daemon._forked_from, daemon._state = os.getppid(), "forked"
        daemon._lock = threading.Lock()
        daemon._finalizer.detach()
    live_daemons.clear()


os.register_at_fork(after_in_child=_forked_child)


def _wait_for_queued_compute(daemon):
    """Let the kernels MindSpore has queued run before the last write-back round of a
    daemon that handed tensors to compute: one may still write a managed tensor (an
    ops.assign in a forward that raised after it, whose unit was released with no fence
    behind it), and a write the scheduler has not seen when it shuts down is lost with the
    daemon. The caller's own compute: close() waits for it like for the write-backs.
    (Not from the scheduler thread, a listener closing the daemon: it may not wait.)"""
    if not daemon._binding.bound_for_compute or daemon._thread is threading.current_thread():
        return
    try:
        framework.synchronize()
    except Exception as e:       # noqa: BLE001 - close() goes on; the write-back round says what it lost
        log.warning("prefetchd %s: waiting for queued compute at close failed: %r", daemon.name, e)


@atexit.register
def _close_live_daemons():
    """Daemons still open at interpreter exit (or whose close() was interrupted) stop
    here, so no native thread outlives the interpreter."""
    for daemon in list(live_daemons):
        try:
            daemon.close(min(5.0, daemon.config.shutdown_timeout))
        except BaseException:
            log.exception("prefetchd %s: close at exit failed", daemon.name)


class Daemon:
    """An in-process tiered-memory daemon. See docs/daemon-api.md for the contract."""

    def __init__(self, config=None, *, backend=None, **overrides):
        backend = backends.object_argument(backend, overrides)
        if config is None:
            config = Config.load(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.config = config
        self.name = config.name
        self.stats = Stats()
        self.timeline = Timeline.from_config(config.trace)   # NullTimeline unless trace/PREFETCHD_TRACE
        self._backend_arg = backend
        self.backend = None
        self._lock = threading.Lock()
        self._state = "new"           # new -> running -> closing -> closed
        self._registry = Registry(self.name)
        self._policy = policies.create(config.policy)
        self._events = Events()
        self._core = None             # the Scheduler, from start()
        self._binding = None
        self._registrar = None        # register() / register_remote(), from start()
        self._thread = None
        self.attachments = Attachments()
        self._shutdown_sent = False
        self._reserve_checks = []     # test hooks: fn(used_after, high) on every reservation

    # ------------------------------------------------------------------ lifecycle
    def start(self):
        with self._lock:
            if self._state == "running":
                return self
            if self._state != "new":
                raise ShutdownError("cannot start a daemon after close()")
            self.backend = self._backend_arg or backends.create(self.config)
            self._binding = Binding(self._lock, self.backend, self.stats)
            homes = HomeSpace(self.backend) if HomeSpace.supported(self.backend) else None
            self._core = Scheduler(self.config, self.backend, self._registry, self._policy, self.stats,
                                   self._lock, emit=self._events.emit, guard=self._binding.guard,
                                   name=self.name)
            self._registrar = Registrar(self._core, self._registry, homes, self._binding)
            self._core.timeline = self.timeline
            self._core.memory.reserve_checks = self._reserve_checks
            self._state = "running"
            live_daemons.add(self)
        self._thread, self._finalizer = _scheduler_thread(self, self._core, self._registry)
        keep_keyboard_interrupt()     # (the backend ran MindSpore's first op, maybe)
        _log_started(self.name, self.config, self.backend)
        try:
            self._attach()
        except BaseException:
            self.close()      # e.g. the metrics port is taken: leave no thread behind
            raise
        return self

    def _attach(self):
        """Build the optional attachments the config asks for."""
        if self.config.metrics_port is not None:
            self.attachments.export_metrics(self, self.config.metrics_addr, self.config.metrics_port)
        if self.config.endpoint:
            self.serve(self.config.endpoint)

    def serve(self, endpoint, **kwargs):
        """Answer other processes over ZeroMQ at `endpoint` (see docs/control-plane.md)."""
        self.check_open()
        return self.attachments.serve(self, endpoint, **kwargs)

    @property
    def metrics_port(self):
        return self.attachments.metrics_port

    @property
    def closed(self):
        return self._state == "closed"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def close(self, timeout=None):
        """Stop within `timeout` seconds: finish write-backs if time allows, cancel the rest.

        Dirty replicas whose write-back cannot finish in time are reported
        (logged) — close() never waits past its bound. Safe to call again, also
        after an interrupted close (an atexit hook does, for daemons left open).
        """
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._state in ("closed", "forked"):     # (a fork's copy: nothing of it runs here)
                return
            first = self._state != "closing"
            started = self._core is not None
            self._state = "closing"
            if started:       # (and guarded tensors say the daemon is gone)
                self._binding.closed_as = f"prefetchd daemon {self.config.name!r}, which is closed"
                self._core.inbox.refuse_new(_refusal(self))
        if first:
            self.attachments.close(deadline, self.name)
        if started:
            if not self._shutdown_sent:
                self._shutdown_sent = True
                _wait_for_queued_compute(self)
                self._core.inbox.shut_down(deadline)
            if self._thread is threading.current_thread():
                # From a listener or a future callback: the scheduler stops once it
                # returns; it cannot wait for itself. A later close() (or the exit hook)
                # finds it stopped and finishes.
                return
            self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
            if self._thread.is_alive():
                log.error("prefetchd %s: scheduler did not stop within %.1fs", self.name, timeout)
                return
            self._finalizer.detach()
        with self._lock:
            self._state = "closed"
            live_daemons.discard(self)
        self.timeline.close()      # writes config.trace once the scheduler has stopped

    @property
    def forked(self):
        """This is a forked child's copy of a daemon of the parent process (refuses everything)."""
        return self._state == "forked"

    def check_open(self):
        """Raise ShutdownError, saying which, unless the daemon is started and not closed."""
        if self._state != "running":
            if self._state == "new":
                raise ShutdownError("daemon not started: call start() or use it as a context manager")
            raise ShutdownError(_refusal(self))

    def _submit(self, request):
        self.check_open()                  # before start(): say so (there is no core yet)
        return self._core.submit(request)  # refused there too once close() began

    # ------------------------------------------------------------------ registration
    def register(self, tensor, name=None, *, tier="device"):
        """Manage `tensor` (a mindspore Tensor or Parameter) under `name`.

        tier: where the data goes now: "device" (a device replica; dirty until
        first written back), "host", or "remote" (written to the store and
        verified; the framework tensor then releases its memory).
        """
        name = checked_name(tensor, name, tier)      # a bad argument says so, also before start()
        self.check_open()
        return TensorHandle(self._registrar.register(tensor, name, tier))

    def register_all(self, tensors, *, tier="remote"):
        """Manage every tensor of `tensors` (each under its own name) on tier "host" or
        "remote", or none: if one placement fails (a full disk), every tensor is as it was
        and the error is raised (core/registering.py). Their handles, in order."""
        if framework.is_tensor(tensors):      # (iterating a tensor gives its rows)
            raise TypeError("register_all takes an iterable of tensors; register() takes one")
        items = [(t, checked_name(t, None, tier)) for t in tensors]
        self.check_open()
        return [TensorHandle(rec) for rec in self._registrar.register_all(items, tier)]

    def register_remote(self, name, shape, dtype, *, target=None):
        """Manage a tensor whose data is already in the store under `name`."""
        check_name(name)
        self.check_open()
        return TensorHandle(self._registrar.register_remote(name, shape, dtype, target))

    def handle(self, name):
        return TensorHandle(self.record(name))

    def names(self):
        with self._lock:
            return list(self._registry.records)

    def record(self, item):
        """The ManagedTensor behind a name, handle or registered tensor (read-only use)."""
        return self._registry.record(item, framework.is_tensor)

    def _records_of(self, tensors):
        return self._registry.records_of(tensors, framework.is_tensor)

    # ------------------------------------------------------------------ requests
    def prefetch(self, tensors, priority=0, deadline=None):
        """Make tensors resident soon. Resolves when they are; never pins them."""
        check_priority(priority)
        check_deadline(deadline)
        recs = self._records_of(tensors)
        self.check_open()
        if self._core.hit(recs):
            return DONE
        for r in recs:
            r.requested = True    # until the scheduler has queued it (see acquire)
        return self._submit(Request(Kind.PREFETCH, recs, RequestFuture(), priority, deadline))

    def pin(self, tensors, priority=0):
        """Wait until resident, then pin (never evicted or moved until unpinned)."""
        check_priority(priority)
        return self._submit(Request(Kind.PIN, self._records_of(tensors), RequestFuture(), priority))

    def unpin(self, tensors):
        self._submit(Request(Kind.UNPIN, self._records_of(tensors)))

    def evict(self, tensors):
        """Drop device replicas (writing dirty ones back first). Fails on pinned tensors."""
        return self._submit(Request(Kind.EVICT, self._records_of(tensors), RequestFuture()))

    def unregister(self, tensors):
        """Stop managing `tensors`, all or none, and wait: their device replicas dropped (dirty
        ones written back), host blocks freed, the store files this daemon wrote removed (a
        staged store keeps its own), records forgotten (core/placement.py). Refused while one
        is pinned or wanted by compute. Their framework tensors refuse use from then on."""
        refuse_wait_on_scheduler("unregister()", self._core)
        self._submit(Request(Kind.UNREGISTER, self._records_of(tensors), RequestFuture())).result()

    def flush(self, tensors=None):
        """Write dirty device replicas back to the remote tier; resolves when verified."""
        recs = None if tensors is None else self._records_of(tensors)
        return self._submit(Request(Kind.FLUSH, recs, RequestFuture()))

    def stage_to_host(self, tensors):
        """Give tensors a host replica read from the remote tier (weights-in-RAM setups)."""
        return self._submit(Request(Kind.STAGE, self._records_of(tensors), RequestFuture()))

    def set_watermarks(self, high, low=None):
        high_b, low_b = _watermark_bytes(high, low, self.config.device_budget)
        return self._submit(Request(Kind.WATERMARKS, (), RequestFuture(), args=(high_b, low_b)))

    def mark_dirty(self, tensors):
        self.check_open()         # closed, nothing would write back what the caller wrote
        for rec in self._records_of(tensors):
            self._binding.on_user_write(rec, "mark_dirty")

    @contextlib.contextmanager
    def use(self, tensors, auto_fetch=True):
        """Pin `tensors` for compute: waits for residency, binds, unpins on exit."""
        recs = self._records_of(tensors)
        keep_keyboard_interrupt()     # (the caller's MindSpore ops may be its first)
        self.compute_session().acquire(recs, auto_fetch=auto_fetch, as_set="daemon.use([...])")
        try:
            yield recs
        finally:      # closed meanwhile: its pins hold nothing, and the body's own error goes on
            with contextlib.suppress(ShutdownError):
                self.unpin(recs)

    def acquire(self, recs, *, auto_fetch=True, stall_timeout=None):
        """Pin and bind records for compute on the calling thread; returns stall seconds
        (see ComputeSession.acquire)."""
        return self.compute_session().acquire(recs, auto_fetch=auto_fetch, stall_timeout=stall_timeout)

    # ------------------------------------------------------------------ compute (the layer hooks)
    def compute_session(self, owner=None):
        """What one model's layer hooks call per unit (core/session.py); `owner` keys its trace."""
        self.check_open()
        return ComputeSession(self, self._core, self._binding, owner)

    def set_trace(self, steps, owner=None):
        """A recorded execution order (one collection of tensor names per unit run) of `owner`."""
        with self._lock:
            if self._core is not None:
                traces.set_trace(self._core, steps, owner)
            else:
                self._policy.set_trace(steps, owner)

    def advance_trace(self, position, owner=None):
        with self._lock:
            self._policy.advance(position, owner)

    # ------------------------------------------------------------------ introspection
    def status(self):
        with self._lock:
            return self._status()

    def _status(self):
        return describe(self.config, self._registry, self._core,
                        closed=self._state in ("closing", "closed"), running=self._state == "running")

    def snapshot(self):
        """(status, stats) copied together under the lock: what one metrics scrape sees."""
        with self._lock:
            return self._status(), self.stats.snapshot()

    def tensors(self, pattern="*"):
        """describe() of every tensor whose name matches the glob `pattern`."""
        return describe_tensors(self._lock, self._registry, self._core, pattern)

    def tiers_of(self, tensor):
        """Where a registered framework tensor's valid replicas are, or None if not registered."""
        with self._lock:
            name = self._registry.name_of(tensor)
            return tuple(self._registry.records[name].tiers) if name is not None else None

    def add_listener(self, fn):
        self._events.add(fn)

    def remove_listener(self, fn):
        self._events.remove(fn)

    def add_reserve_check(self, fn):
        """Test hook: fn(used_after, high) runs at every device reservation."""
        self._reserve_checks.append(fn)


def _log_started(name, config, backend):
    log.info("prefetchd %s: started (backend %s, device budget %d B, watermarks %d/%d B, host budget "
             "%d B, store %s); set: %s", name, config.backend, config.device_budget,
             config.high_watermark, config.low_watermark, config.host_budget,
             config.store_dir or "a private temporary directory",
             ", ".join(f"{k} from {v}" for k, v in sorted(config.sources().items())) or "defaults")
    log.info("prefetchd %s: I/O engine %s (%s)", name, backend.io_engine,
             getattr(getattr(backend, "store", None), "probe_report", "no probe report"))


def _watermark_bytes(high, low, budget):
    """(high, low) watermarks in bytes of set_watermarks' arguments (fractions of the device
    budget or sizes; low defaults to 85% of high); ValueError for a pair that cannot hold."""
    high_b = parse_fraction_or_size(high, budget, "high_watermark")
    low_b = parse_fraction_or_size(low, budget, "low_watermark") if low is not None else int(high_b * 0.85)
    if not PAGE <= high_b <= budget:      # below a page no tensor could ever fit
        raise ValueError(f"high watermark {high_b} must be in [{PAGE}, device budget {budget}]")
    if low_b > high_b:
        raise ValueError(f"low watermark {low_b} is above the high watermark {high_b}")
    return high_b, low_b


def _scheduler_thread(daemon, core, registry):
    """The started scheduler thread of `daemon`, and the finalizer that shuts down (and
    says so) a daemon its owner dropped without close()."""
    thread = threading.Thread(
        target=run, args=(weakref.ref(daemon), core, lambda: _release(registry), daemon._events.deliver),
        name=f"prefetchd-scheduler-{daemon.name}", daemon=True)
    thread.start()
    finalizer = weakref.finalize(daemon, _reclaim, daemon.name, core, thread, daemon.config.shutdown_timeout)
    finalizer.atexit = False    # at exit, _close_live_daemons closes it properly
    return thread, finalizer


def _release(registry):
    """The scheduler has stopped (close(), from a callback too, or a dropped daemon): resident
    tensors keep viewing their blocks, and other daemons may manage them from now on."""
    Binding.release_all(registry)
    registry.release_targets()


def _reclaim(name, core, thread, timeout):
    """weakref finalizer of a started Daemon dropped without close()."""
    log.warning("prefetchd %s: daemon dropped without close(); shutting it down", name)
    core.inbox.shut_down(time.monotonic() + min(timeout, 5.0))
    if thread is not threading.current_thread():
        thread.join(min(timeout, 5.0) + 1.0)
