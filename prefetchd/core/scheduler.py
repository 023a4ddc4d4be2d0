"""The scheduler thread: the one owner of residency state.

Any thread submits requests into `inbox` and wakes the backend's completion
queue; the thread blocks there (no polling) and, per wake-up, under the
daemon's lock: applies finished transfers, handles new requests, frees memory
whose compute fence passed, starts queued loads, settles evict/flush requests
that waited on transfers. Requests and completions are routed by table.
Futures are settled after the lock is released.

Shape after CPython's concurrent.futures.thread: one small loop, a sentinel
(the shutdown request) to stop it, refusals that say why. A failure while
handling one request or completion fails that request and leaves its
tensors in a named state; the loop keeps serving.
"""
import itertools
import logging
import time

from ..backend.base import TransferKind
from ..errors import PrefetchdError, ShutdownError
from ..telemetry.timeline import NullTimeline
from . import lending
from .compute_writes import note_writes
from .explicit import ExplicitRequests
from .host_replicas import HostReplicas
from .hostcache import HostCache
from .inbox import Inbox
from .loads import Loads
from .memory import DeviceMemory
from .placement import Placements
from .records import State
from .requests import Kind, Outcomes, Request, settle
from .transfers import Transfers
from .waits import mark_scheduler_thread
from .watermarks import WatermarkChanges
from .writeback import WriteBacks

log = logging.getLogger("prefetchd")


class Scheduler:
    """Scheduler state and handlers. Everything but `submit`, `hit` and the inbox's
    `refuse_new` / `shut_down` runs on the scheduler thread, under `lock`."""

    def __init__(self, config, backend, registry, policy, stats, lock, *, emit, guard, name):
        self.config = config
        self.backend = backend
        self.registry = registry
        self.policy = policy
        self.stats = stats
        self.lock = lock
        self.name = name
        self.emit = emit               # fn(event, rec, seconds=0.0, error=None)
        self.guard = guard             # fn(rec): make Python-level use of rec's tensor refuse
        self.inbox = Inbox(lock, backend)   # the one entry for other threads: submit, refuse_new, shut_down
        self.outcomes = Outcomes(stats)
        self.transfers = Transfers()
        self.memory = DeviceMemory(config, backend, registry, policy, stats, lock)
        # With a shared host tier, clean replicas live there (one copy per machine):
        # the private budget keeps only what must be private (host-tier tensors).
        self.hostcache = HostCache(backend, registry, policy, stats,
                                   0 if config.shared_host else config.host_budget)
        self.host_replicas = HostReplicas(config, backend, self.hostcache, self.transfers, self.outcomes,
                                          stats)
        self.writebacks = WriteBacks(backend, self.memory, self.transfers, self.host_replicas, stats,
                                     emit=emit, guard=guard)
        self.loads = Loads(config, backend, self.memory, self.transfers, self.outcomes, self.hostcache,
                           self.host_replicas, stats, tick=self.tick, emit=emit,
                           evict=self.writebacks.evict)
        self.placements = Placements(backend, registry, self.transfers, self.outcomes, self.host_replicas, stats)
        self.memory.connect(evict=self.writebacks.evict, written_late=self.writebacks.written_late)
        self.explicit = ExplicitRequests(registry, self.memory, self.writebacks, self.outcomes, self.note_writes,
                                         self.placements.forget)
        self.watermarks = WatermarkChanges(self.memory, self.outcomes, self.transfers)
        self._tick = itertools.count(1)
        self.shutdown_deadline = None
        self.timeline = NullTimeline()   # the daemon sets its own when tracing is on
        self._requests = {
            Kind.PREFETCH: self.loads.want_resident,
            Kind.PIN: self.loads.want_resident,
            Kind.UNPIN: self._unpin,
            Kind.REGISTER: self._register,
            Kind.EVICT: self.explicit.evict,
            Kind.FLUSH: self.explicit.flush,
            Kind.STAGE: self.host_replicas.stage,
            Kind.WATERMARKS: self.watermarks.start,
            Kind.FORGET: self.placements.forget,
            Kind.UNREGISTER: self.explicit.unregister,
        }
        # Completions by transfer kind: fn(rec, request or None, completion, seconds).
        self._completions = {
            TransferKind.LOAD: lambda rec, req, c, s: self.loads.done(rec, TransferKind.LOAD, c, s),
            TransferKind.H2D: lambda rec, req, c, s: self.loads.done(rec, TransferKind.H2D, c, s),
            TransferKind.STORE: self.writebacks.store_done,
            TransferKind.VERIFY: self.writebacks.verify_done,
            # A stage request's read, or (no request) the first half of a load via the host cache.
            TransferKind.STAGE: lambda rec, req, c, s: (self.host_replicas.staged(rec, req, c) if req
                                                        else self.loads.staged(rec, c, s)),
        }
        # ... and those of a register(tier="host" | "remote"), which carry their request.
        self._placing = {
            TransferKind.STORE: self.placements.stored,
            TransferKind.VERIFY: self.placements.verified,
            TransferKind.D2H: self.placements.copied,
        }

    @property
    def timeline(self):
        return self._timeline

    @timeline.setter
    def timeline(self, timeline):
        """The daemon's recorder (when tracing is on): the moves record into it too."""
        self._timeline = self.loads.timeline = self.writebacks.timeline = timeline

    # ------------------------------------------------------------------ any thread
    def submit(self, request):
        """Queue `request` for the scheduler thread; returns its future (core/inbox.py)."""
        if request.future is not None:
            request.future.settled_by = self      # (core/waits.py: who must not wait for it)
        if request.kind is Kind.UNPIN:
            self._guard_released(request.recs)
        return self.inbox.submit(request)

    def _guard_released(self, recs):
        """Guard, on the unpinning thread, each offloaded model's tensor whose last pin an unpin
        gives up: until this thread applies the unpin, a Python-level write would be taken
        outside any forward (mindspore.load_param_into_net right after a forward set the
        root's weights, and was refused only at the first evicted one). A pin taken meanwhile
        tracks it again (Binding.bind_for_compute); _unpin guards it again, harmlessly."""
        with self.lock:
            for rec in recs:
                if rec.pins == 1 and rec.guard_unpinned:
                    self.guard(rec)

    def hit(self, recs):
        """A prefetch of recs that needs no request: True if every one is resident (any
        thread). Reading `state` races only with an eviction that could follow a queued hit
        just as well; each is then kept for its use like a queued hit (core/loads.py), also
        when an unpin queued before this is not applied yet: else a later prefetch evicts it
        (the root at every pass start)."""
        if not all(r.state is State.RESIDENT for r in recs):
            return False
        tick = self.tick()
        with self.lock:
            for r in recs:
                r.last_use = tick
                if r.state is State.RESIDENT:
                    r.prefetched_unused = True
            self.stats.count("prefetch", "hit")
        return True

    # ------------------------------------------------------------------ scheduler thread
    def next_seq(self):
        return self.inbox.next_seq()

    def tick(self):
        return next(self._tick)

    def note_writes(self, rec):
        """Dirty rec if compute wrote it in place since we last looked (core/compute_writes.py)."""
        note_writes(self.backend, self.stats, rec)

    # ------------------------------------------------------------------ one iteration
    def step(self, completions):
        """Apply completions and handle the inbox. Returns True once shut down."""
        for c in completions:
            self._guarded(self._on_completion, c)
        while self.inbox:
            req = self.inbox.popleft()
            if req.kind is Kind.SHUTDOWN:
                self.shutdown_deadline = req.args
                self._guarded(self._shutdown)
                break
            self._guarded(self._handle, req)
        # Free what finished compute since; above the high watermark (just lowered), all of it
        self._guarded(self.memory.fence_if, self.memory.above_high)
        if self.shutdown_deadline is None:
            self._guarded(self.loads.pump)
        self._guarded(self.explicit.settle)
        self._guarded(self.watermarks.settle)
        stop = self.shutdown_deadline is not None and (
            not self.transfers or time.monotonic() >= self.shutdown_deadline)
        if stop:
            self._finish()
        return stop

    def _guarded(self, fn, arg=None):
        """Run one handler; a failure refuses what it was handling, never the loop."""
        try:
            return fn() if arg is None else fn(arg)
        except Exception as e:
            log.exception("prefetchd %s: scheduler step %s failed", self.name, getattr(fn, "__name__", fn))
            self._recover(arg, e)

    def _recover(self, item, error, recs=None):
        """Return what a failed step touched to a consistent state and fail its request."""
        err = PrefetchdError(f"internal error while scheduling: {error!r}")
        req = item if isinstance(item, Request) else None
        for rec in recs if recs is not None else (req.recs or () if req is not None else ()):
            self._settle_record(rec, err)
        if req is not None and req.future is not None:
            self.outcomes.fail(req, err)

    def _settle_record(self, rec, error):
        """Put a record whose move broke midway back into a named, usable state."""
        if rec.state is State.LOADING and not self.transfers.involves(rec):
            if rec.block is not None:
                lending.give_back(self.backend, self.stats, rec, rec.block)
                self.backend.free_device(rec.block)
            rec.block, rec.state = None, State.ABSENT
            self.outcomes.fail_waiters(rec, error)
        elif rec.state is State.STORING and not self.transfers.involves(rec):
            rec.state, rec.writeback_failed, rec.error = State.RESIDENT, True, error
            rec.evict_after_store = None

    # ------------------------------------------------------------------ routing
    def _on_completion(self, c):
        entry = self.transfers.pop(c.tag)
        if entry is None:
            return
        kind, rec, req = entry
        self.timeline.transfer(kind.value, rec.name, rec.nbytes, c.start_ns, c.end_ns, ok=not c.status)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("prefetchd %s: %s of %r (%d B) %s in %.3f ms", self.name, kind.value, rec.name,
                      rec.nbytes, f"failed: {c.message}" if c.status else "done", (c.end_ns - c.start_ns) / 1e6)
        seconds = max(0.0, (c.end_ns - c.start_ns) / 1e9)
        table = self._placing if req is not None and req.kind is Kind.REGISTER else self._completions
        try:
            table[kind](rec, req, c, seconds)
        except Exception as e:
            log.exception("prefetchd %s: applying a %s completion of %r failed", self.name, kind.value, rec.name)
            self._recover(req, e, recs=(rec,))

    def _handle(self, req):
        if req.future is not None and req.future.cancelled():
            self.stats.count(req.counted_as, "cancelled")
            return
        self.stats.queue_wait.observe(time.monotonic() - req.submitted)
        self._requests[req.kind](req)

    # ------------------------------------------------------------------ small requests
    def _register(self, req):
        if req.args[1] == "device":
            req.recs[0].initial = req.args[0]
            self.loads.register_on_device(req)
        else:
            self.placements.start(req)

    def _unpin(self, req):
        for rec in req.recs:
            if rec.pins > 0:
                rec.pins -= 1
                rec.last_use = self.tick()
                if not rec.pins and rec.guard_unpinned:
                    self.guard(rec)      # (under the lock: a pin that follows tracks it again)

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self):
        """Cancel what has not started; write back dirty replicas while time allows."""
        err = ShutdownError("daemon closed before the request completed")
        self.loads.cancel_all(err)
        self.watermarks.cancel(err)
        while self.inbox:
            req = self.inbox.popleft()
            if req.future is not None:
                self.outcomes.resolve(req, err)
        if self.config.store_dir:   # a private temporary store dies with the daemon anyway
            for rec in self.registry:
                self.note_writes(rec)
                if rec.state is State.RESIDENT and rec.dirty:
                    # One more try also for a write-back that failed before: the
                    # fault may have passed, and this is the last chance.
                    rec.writeback_failed = False
                    self.writebacks.start(rec)

    def _finish(self):
        """Release everything (after the last transfer settled, or the deadline passed)."""
        dirty = [r for r in self.registry if r.dirty and self.config.store_dir]
        lost = [r.name for r in dirty if r.state is State.RESIDENT]
        racing = [r.name for r in dirty if r.state is State.STORING]
        if lost:
            log.error("prefetchd %s closed with %d dirty tensor(s) not written back: %s",
                      self.name, len(lost), ", ".join(map(str, lost[:10])))
        if racing:   # the store commits a version only once it is whole: old or new, never a mix
            log.warning("prefetchd %s closed with %d write-back(s) still in flight, each landed whole "
                        "or not at all (a reopened store has its new or its last version): %s",
                        self.name, len(racing),
                        ", ".join(map(str, racing[:10])))
        self.explicit.cancel_all(ShutdownError("daemon closed before the request completed"))
        for rec in self.registry:
            lending.drop_parked(self.backend, self.stats, rec, mappings=True)   # they go with the daemon
            rec.block = None
            rec.host_block = None
        self.memory.close()


def run(daemon_ref, scheduler, release_targets, deliver_events=lambda: None):
    """The scheduler thread's body. Holds the daemon only weakly between iterations,
    so a daemon its owner dropped can be collected (and its finalizer close it).

    Listeners (`deliver_events`) and future callbacks run after the lock is
    released: they may call back into the daemon (status, flush, close)."""
    mark_scheduler_thread(scheduler)
    backend = scheduler.backend
    while True:
        deadline = scheduler.shutdown_deadline
        timeout = 0.5 if deadline is None else min(max(0.0, deadline - time.monotonic()), 0.05)
        completions = backend.wait_completions(timeout)
        with scheduler.lock:
            try:
                stop = scheduler.step(completions)
            except Exception:   # step guards each handler; this is a last resort
                log.exception("prefetchd %s: scheduler iteration failed", scheduler.name)
                stop = scheduler.shutdown_deadline is not None
            settled = scheduler.outcomes.take()
            if stop:
                release_targets()
        try:
            deliver_events()     # before the futures: a waiter sees the listener's effects
        except Exception:
            log.exception("prefetchd %s: delivering events failed", scheduler.name)
        if settled:
            daemon = daemon_ref()
            unpin = daemon.unpin if daemon is not None else (lambda recs: None)
            for req, error in settled:
                settle(req, error, unpin)
            del daemon, unpin     # no strong reference between iterations
        if stop:
            try:
                backend.close()
            finally:
                return
