"""Loads: making tensors resident (ABSENT -> LOADING -> RESIDENT).

Each move has two halves: `start` reserves what it needs, marks the record
and issues one asynchronous transfer; `done` applies its completion. Both
run on the scheduler thread under the daemon's lock; what they reach (backend,
memory, transfers, outcomes, host replicas) is given to the constructor, so
they run unchanged against a fake backend with no threads.
"""
import heapq
import itertools
import logging
import time

from ..backend.base import Completion, TransferKind
from ..errors import BudgetError, NotResidentError, PrefetchdError, StorageError
from ..telemetry.timeline import NullTimeline
from . import lending
from .compute_writes import note_writes
from .records import State
from .requests import Kind
from .transfers import transfer_error

MAX_LOADS_IN_FLIGHT = 4   # enough to keep the store's queue full; more only delays priorities
RETRY_FAILED_WRITEBACKS = 1.0   # seconds between retries, by a load with no room, of failed write-backs

log = logging.getLogger("prefetchd")


class Loads:
    def __init__(self, config, backend, memory, transfers, outcomes, hostcache, host_replicas, stats,
                 *, tick, emit, evict):
        self._config = config
        self._backend = backend
        self._memory = memory
        self._transfers = transfers
        self._outcomes = outcomes
        self._hostcache = hostcache
        self._host = host_replicas
        self._stats = stats
        self._tick = tick              # fn() -> the use clock's next value
        self._emit = emit              # fn(event, rec, seconds=0.0, error=None)
        self._evict = evict            # fn(rec, reason): the write-back path's evict
        self.timeline = NullTimeline()   # the scheduler's, when tracing is on
        self._order = itertools.count()
        self._retry_at = 0.0           # monotonic time failed write-backs may be tried again
        self.queue = []            # heap: (speculative?, deadline, -priority, seq, -nbytes, n, rec, request)

    # ------------------------------------------------------------------ requests
    def want_resident(self, req):
        """prefetch / pin: satisfy now from resident tensors, queue loads for the rest."""
        missing = []
        for rec in req.recs:
            rec.requested = False      # from here on, waiters and the load queue say it
            self.reclaim(rec)
            if rec.state in (State.RESIDENT, State.STORING):
                if req.kind is Kind.PIN:
                    rec.pins += 1
                    req.pinned.append(rec)
                    rec.prefetched_unused = False
                elif req.kind is Kind.PREFETCH and not rec.pins:
                    # A hit is a prefetch too: kept for its use like a loaded one, else a
                    # later prefetch could evict it once compute moves on (e.g. the root
                    # unit at a pass start, whose next use then looks farthest).
                    rec.prefetched_unused = True
                    if rec.evict_after_store == "watermark":
                        # Wanted again while written back on its way out: the write-back
                        # completes, the drop does not (a load waiting for the room makes
                        # it again from other victims). An explicit evict() still wins.
                        rec.evict_after_store = None
                rec.last_use = self._tick()
                continue
            if rec.state is State.ABSENT and not (rec.remote_valid or rec.host_valid):
                self._outcomes.fail(req, NotResidentError(
                    rec.name, "", rec.state.value,
                    f"tensor {rec.name!r} has no valid replica on any tier (freed or never written)"))
                return
            missing.append(rec)
        if not missing:
            self._stats.count(req.counted_as, "hit")
            self._outcomes.resolve(req)
            return
        self._stats.count(req.counted_as, "miss" if req.kind is Kind.PIN else "issued")
        req.remaining = len(missing)
        for rec in missing:
            rec.waiters.append(req)
            if rec.state is State.ABSENT:
                self.enqueue(rec, req)

    def register_on_device(self, req):
        """register(tier="device"): place the given values in a device replica."""
        rec = req.recs[0]
        req.remaining = 1
        rec.waiters.append(req)
        self.enqueue(rec, req)

    def enqueue(self, rec, req):
        # Compute waiting on a tensor (pin) goes before speculation (prefetch).
        deadline = req.deadline if req.deadline is not None else float("inf")
        # Within one request, largest first: big blocks placed first fragment the arena least.
        heapq.heappush(self.queue, (not req.demand, deadline, -req.priority, req.seq, -rec.nbytes,
                                    next(self._order), rec, req))

    def cancel_all(self, error):
        while self.queue:
            *_, rec, _req = heapq.heappop(self.queue)
            self._outcomes.fail_waiters(rec, error)

    # ------------------------------------------------------------------ starting
    def pump(self):
        """Start queued loads in priority order while memory and stream slots allow."""
        while self.queue and self._transfers.loads < MAX_LOADS_IN_FLIGHT:
            *_, rec, req = self.queue[0]
            rec.waiters = [w for w in rec.waiters if not w.future.cancelled()]
            if rec.state is not State.ABSENT or not rec.waiters:
                heapq.heappop(self.queue)   # satisfied, or every waiter gone
                continue
            if self.reclaim(rec):
                heapq.heappop(self.queue)
                continue
            try:
                block = self._memory.reserve(rec.nbytes, demand=req.demand, incoming=rec)
            except BudgetError as e:
                heapq.heappop(self.queue)
                self._outcomes.fail_waiters(rec, e)
                continue
            except Exception as e:
                # Making room failed inside (e.g. a page move the kernel refused). Retrying
                # on every step would fail the same way while the waiters wait forever:
                # refuse this load and say why; the tensor stays ABSENT and loadable.
                log.exception("prefetchd: reserving device memory for %r failed", rec.name)
                heapq.heappop(self.queue)
                self._outcomes.fail_waiters(rec, PrefetchdError(
                    f"internal error while making room on the device for {rec.name!r}: {e!r}"))
                continue
            if block is None:
                if self._transfers or self._memory.unfenced or self._retry_failed_writebacks():
                    return    # write-backs or loads in flight will free or settle memory
                # Nothing in flight can change the picture: say so instead of waiting forever.
                heapq.heappop(self.queue)
                self._outcomes.fail_waiters(rec, BudgetError(
                    f"cannot load {rec.name!r} ({rec.nbytes} bytes): the device tier is held by pinned "
                    f"tensors, prefetched tensors not used yet, or tensors whose write-back failed "
                    f"(used {self._memory.used()} of high watermark {self._memory.high} bytes"
                    f"{self._memory.held_by_failed_writebacks()}); a "
                    f"prefetch never evicts a tensor prefetched and not used yet (use() or pin() may: "
                    f"they are demand), so use or evict() those first"))
                continue
            heapq.heappop(self.queue)
            self.start(rec, block)

    def _retry_failed_writebacks(self):
        """Start writing back again, and then dropping, the tensors held because their write-back
        failed (the fault may have passed: the disk has room again), at most every
        RETRY_FAILED_WRITEBACKS seconds: before, a load with no room failed until a flush().
        True if any was started."""
        now = time.monotonic()
        if now < self._retry_at:
            return False
        held = [r for r in self._memory.registry
                if r.writeback_failed and r.state is State.RESIDENT and r.block is not None and not r.pins]
        if not held:
            return False
        self._retry_at = now + RETRY_FAILED_WRITEBACKS
        for rec in held:
            rec.writeback_failed = False
            self._evict(rec, "watermark")
        return True

    def reclaim(self, rec):
        """An ABSENT tensor whose pages still sit at its home, waiting for a compute
        fence before they leave, is resident again at no cost. True if so."""
        if rec.state is not State.ABSENT or rec.home is None or not self._memory.reclaim(rec):
            return False
        self._stats.reclaims += 1
        self.arrived(rec)
        return True

    def start(self, rec, block):
        """Fill a reserved device block: from register()'s values, from the host
        replica, or from the remote tier — through a new host replica when the host
        cache admits it (so later loads copy from RAM), else straight from disk."""
        rec.state = State.LOADING
        rec.block = block
        rec.exposed = False
        self.timeline.decision("load", rec.name, rec.nbytes, source="register" if rec.initial is not None
                            else "host" if rec.host_valid or rec.mapping_parked else "remote")
        if rec.initial is not None:
            self._copy_in(rec, rec.initial)
        elif rec.mapping_parked:      # its shared-tier mapping waits under the home: no request
            self._stats.loads_from["host"] += 1
            self._stats.load_bytes_from["host"] += rec.nbytes
            self._at_home(rec, TransferKind.LOAD, lending.unpark_mapping)
        elif rec.host_valid:
            self._stats.loads_from["host"] += 1
            self._stats.load_bytes_from["host"] += rec.nbytes
            self._fill_from_host(rec)
        else:
            self._stats.loads_from["remote"] += 1
            self._stats.load_bytes_from["remote"] += rec.nbytes
            if rec.host_block is None and self._hostcache.admit(rec) and self._host.try_alloc(rec):
                self._issue(rec, TransferKind.STAGE, lambda tag: self._backend.start_load(
                    rec.name, rec.host_block, rec.nbytes, tag, self._config.verify_reads))
            else:
                self._issue(rec, TransferKind.LOAD, lambda tag: self._backend.start_load(
                    rec.name, block, rec.nbytes, tag, self._config.verify_reads, shape=rec.shape,
                    dtype=rec.dtype))

    def _copy_in(self, rec, source):
        self._issue(rec, TransferKind.H2D, lambda tag: self._backend.start_copy(
            TransferKind.H2D, rec.block, source, rec.nbytes, tag, shape=rec.shape, dtype=rec.dtype))

    def _fill_from_host(self, rec):
        """The device replica from the host replica: its pages moved straight under the
        home where the tiers share RAM (cpu; done here, the host block lent until the
        drop: core/lending.py), else a copy into the block whose completion comes later.
        lending.page_move_load decides, as it does for the hooks' prefetch window."""
        if lending.page_move_load(self._backend, rec):
            self._at_home(rec, TransferKind.H2D, lending.lend)
            return
        rec.reading_host = True
        tag = self._transfers.add(TransferKind.H2D, rec)
        try:
            self._backend.fill_from_host(rec.block, rec.host_block, rec.nbytes, tag,
                                         shape=rec.shape, dtype=rec.dtype)
        except Exception as e:   # nothing started: back to ABSENT, the waiters learn why
            self._transfers.discard(tag)
            self._failed(rec, StorageError(f"cannot start loading {rec.name!r} from the host tier: {e}"))

    def _at_home(self, rec, kind, move):
        """Complete a load whose pages are put under the home by one page move or
        permission change, done here (lending.lend, lending.unpark_mapping): no transfer."""
        start = time.monotonic_ns()
        try:
            move(self._backend, self._stats, rec)
        except Exception as e:   # nothing moved: back to ABSENT, the waiters learn why
            self._failed(rec, StorageError(f"cannot load {rec.name!r} from the host tier: {e}"))
            return
        end = time.monotonic_ns()
        self.timeline.transfer(kind.value, rec.name, rec.nbytes, start, end, ok=True)
        try:
            self.done(rec, kind, Completion(0, 0, nbytes=rec.nbytes, start_ns=start, end_ns=end),
                      (end - start) / 1e9, at_home=True)
        except Exception as e:
            log.exception("prefetchd: completing the page move of %r failed", rec.name)
            if rec.state is State.LOADING:    # the pages go back to their tier, the load fails
                self._failed(rec, PrefetchdError(f"internal error while loading {rec.name!r}: {e!r}"),
                             at_home=True)

    def _issue(self, rec, kind, start):
        """Start one transfer of a load; if it cannot start, the load fails (nothing lost)."""
        tag = self._transfers.add(kind, rec)
        try:
            start(tag)
        except Exception as e:   # nothing was started: back to ABSENT, the waiters learn why
            self._transfers.discard(tag)
            self._failed(rec, StorageError(f"cannot start loading {rec.name!r}: {e}"))

    # ------------------------------------------------------------------ completions
    def done(self, rec, kind, c, seconds, at_home=False):
        """A load's transfer completed (`at_home`: its pages are under the home already)."""
        rec.initial = None
        rec.reading_host = False
        if c.status:
            self._failed(rec, transfer_error(self._stats, "read", rec, c), seconds)
            return
        if kind is TransferKind.H2D and not at_home:
            self._stats.copied_bytes += rec.nbytes
        if rec.home is not None and not at_home:        # page tables only, no copy
            lending.timed(self._stats, self._backend.attach, rec.home, rec.block)
        self.arrived(rec)
        self._stats.record_transfer(kind.value if kind is TransferKind.H2D else "load", rec.nbytes, seconds)
        self._emit("loaded", rec, seconds)

    def arrived(self, rec):
        """rec is RESIDENT now (loaded, or reclaimed before its pages left): wake its waiters."""
        registering = any(req.kind is Kind.REGISTER for req in rec.waiters)
        rec.state = State.RESIDENT
        rec.dirty = registering
        note_writes(self._backend, self._stats, rec)       # reclaimed: compute may have written it before it was dropped
        rec.error = None
        rec.last_use = self._tick()
        rec.prefetched_unused = not any(req.kind in (Kind.PIN, Kind.REGISTER) for req in rec.waiters)
        waiters, rec.waiters = rec.waiters, []
        for req in waiters:
            if req.future.done():
                continue
            if req.kind is Kind.PIN:
                rec.pins += 1
                req.pinned.append(rec)
                rec.prefetched_unused = False
            req.remaining -= 1
            if req.remaining == 0:
                self._outcomes.resolve(req)
        if rec.evict_after_load:
            # Pinned on arrival: the evict request, still waiting, drops it once unpinned;
            # a flag left set would drop the tensor again on its next, unrelated load.
            rec.evict_after_load = False
            if not rec.pins:
                self._evict(rec, "explicit")

    def _failed(self, rec, error, seconds=0.0, at_home=False):
        """The load failed: the block goes (`at_home`: its pages leave the home first)."""
        rec.reading_host = False
        if at_home:
            lending.release_home(self._backend, self._stats, rec, rec.block)
        self._backend.free_device(rec.block)
        rec.block = None
        rec.state = State.ABSENT
        rec.evict_after_load = False
        rec.error = error
        self._emit("failed", rec, seconds, str(error))
        self._outcomes.fail_waiters(rec, error)

    # ------------------------------------------------------------------ through the host cache
    def staged(self, rec, c, seconds):
        """The first half of a load through the host cache: the disk read into a new host
        replica landed; copy (or move) it on to the device block."""
        if c.status:
            self._host.free(rec)
            self._failed(rec, transfer_error(self._stats, "read", rec, c), seconds)
            return
        rec.host_valid = True
        self._stats.record_transfer("load", rec.nbytes, seconds)
        self._fill_from_host(rec)
