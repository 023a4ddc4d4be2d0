"""The compute session: what the layer hooks (and Daemon.use) call around compute.

One session per offloaded model; its `owner` keys that model's trace in the
policy. Per unit:

    stall = session.acquire(records)          wait until resident, pin, bind; the stall
    ...the unit's kernels are dispatched...
    session.release(records, output)          a compute fence behind `output`, then unpin

and `session.at(position)` tells the policy where compute is in the trace.
It submits the records it holds straight to the scheduler (no lookup by name or
handle): per call a constant number of lock rounds, not one per record.
"""
import time

from ..errors import BudgetError, NotResidentError, ShutdownError
from . import lending, traces
from .records import State
from .requests import Kind, Request
from .waits import RequestFuture, refuse_wait_on_scheduler


# Queued requests a resident pin may overtake (ComputeSession._pin_resident).
_PIN_MAY_PASS = frozenset((Kind.PREFETCH, Kind.PIN, Kind.UNPIN))


class ComputeSession:
    def __init__(self, daemon, core, binding, owner):
        self._daemon = daemon          # prefetch (its hit path)
        self._core = core              # submit, lock, stats, policy, memory
        self._binding = binding
        self.owner = owner
        self.timeline = daemon.timeline
        self.marker = daemon.backend.compute_marker()   # per-unit compute fences, or None

    # ------------------------------------------------------------------ per unit
    def acquire(self, records, *, auto_fetch=True, stall_timeout=None, unit=None, as_set=None):
        """Pin and bind records for compute on the calling thread; returns stall seconds.

        With auto_fetch=False a tensor that is neither resident nor on its way
        raises NotResidentError instead of being fetched (counted as a miss).
        `as_set` names the call (daemon.use) whose records, together, could never fit
        is refused as a set (refuse_more_than_fits).
        """
        if as_set is not None:
            self.refuse_more_than_fits(records, as_set)
        core = self._core
        if not auto_fetch:
            with core.lock:
                missing = next((r for r in records if r.state is State.ABSENT and not r.requested
                                and not r.waiters), None)
                if missing is not None:
                    core.stats.count("fetch", "miss")
            if missing is not None:
                raise NotResidentError(missing.name, ",".join(missing.tiers), missing.state.value)
        started = time.monotonic_ns()
        if not self._pin_resident(records):
            refuse_wait_on_scheduler("use()/acquire() of tensors not resident", self._core)
            self._wait_for_pin(self._core.submit(Request(Kind.PIN, records, RequestFuture())), records,
                               stall_timeout)
        ended = time.monotonic_ns()
        if records:
            self.timeline.stall(unit or records[0].name, started, ended, tensors=len(records))
        self._binding.bind_for_compute(records)
        stall = (ended - started) / 1e9
        with core.lock:
            core.stats.stall.observe(stall)
        if unit is not None:
            self.timeline.compute_begin(unit)
        return stall

    def refuse_more_than_fits(self, records, what):
        """BudgetError if `records` together could never be resident under the high watermark
        (`what` names the call): said of the set, where the pin would name one tensor of it."""
        memory = self._core.memory
        need = sum(memory.backend.block_bytes(r.nbytes) for r in records)
        if need > memory.high:
            raise BudgetError(f"{what} of {len(records)} tensors needs {need} bytes on the device at once; "
                              f"the high watermark is {memory.high} bytes (device budget "
                              f"{memory.config.device_budget}): use fewer tensors at a time, or raise "
                              f"device_budget")

    def _wait_for_pin(self, pinned, records, timeout):
        """Wait for a PIN request's future. Interrupted (Ctrl-C, SystemExit) or timed out, the
        pin still lands, with nobody left to release it: it is released as it lands."""
        try:
            pinned.result(timeout=timeout)
        except BaseException as e:
            if not isinstance(e, Exception) or isinstance(e, TimeoutError):
                pinned.add_done_callback(lambda f: f.exception() is None and self._unpin(records))
            raise

    def _unpin(self, records):
        try:
            self._core.submit(Request(Kind.UNPIN, records))
        except ShutdownError:
            pass                  # the daemon closes: pins no longer hold anything

    def _pin_resident(self, records):
        """Pin records that are all resident right here: no round trip through the
        scheduler thread, whose wake-up behind compute on busy cores costs about a
        millisecond per unit (docs/performance.md, "Parked pages"). Only when every
        request queued before this pin is a prefetch, pin or unpin: those never take a
        resident tensor away except as a victim, which a pin may rightly protect (the pin
        could have been queued first), so the outcome is one the scheduler could have
        produced; an evict, flush, watermark change or registration queued before keeps
        its turn. The same bookkeeping as a pin the scheduler finds resident
        (core/loads.py); the unpin is queued as before. True if pinned."""
        core = self._core
        with core.lock:
            if (not core.inbox.accepting or any(req.kind not in _PIN_MAY_PASS for req in core.inbox)
                    or any(r.state is not State.RESIDENT for r in records)):
                return False
            tick = core.tick()
            for rec in records:
                rec.pins += 1
                rec.prefetched_unused = False
                rec.last_use = tick
            core.stats.count("fetch", "hit")
            return True

    def release(self, records, output=None, *, unit=None):
        """Compute that read `records` was dispatched (its result is `output`): put a
        compute fence behind it, so their memory is reused only once it ran; unpin.
        Returns the fence's epoch (None without per-unit fences)."""
        epoch = None
        if self.marker is not None and output is not None:
            try:
                epoch = self.marker.mark(output)
            except BaseException:
                # The compute behind `output` failed: MindSpore raises an op's error at the
                # next op that uses its result, this fence. Unpinned all the same (else
                # the pins outlived the forward and starved every other model), with no
                # epoch: their memory waits for a whole-queue fence. The error is the caller's.
                self._unpin_unfenced(records)
                raise
            with self._core.lock:
                for rec in records:
                    rec.compute_epoch = epoch
        if unit is not None:
            # The compute span ends when MindSpore reaches the fence (or now, without one).
            self.timeline.compute_end(unit, self.marker if epoch is not None else None, epoch)
        self._core.submit(Request(Kind.UNPIN, records))
        return epoch

    def _unpin_unfenced(self, records):
        with self._core.lock:
            for rec in records:
                rec.compute_epoch = None
        self._core.submit(Request(Kind.UNPIN, records))

    def prefetch(self, records, priority=0):
        return self._daemon.prefetch(records, priority=priority)

    def moves_bytes(self, units):
        """Per collection of records: whether bringing it to the device moves bytes (a disk
        read, a copy, or such a load already under way), rather than nothing (resident) or
        a page move (a host replica the backend lends, pages or a mapping parked under the
        home: core/lending.py). What the hooks' prefetch window counts (hooks/passes.py)."""
        with self._core.lock:
            return [any(self._moves(rec) for rec in records) for records in units]

    def _moves(self, rec):
        if rec.state in (State.RESIDENT, State.STORING):
            return False
        if rec.state is State.LOADING:
            return True
        return not lending.page_move_load(self._core.backend, rec)

    # ------------------------------------------------------------------ the trace
    def set_trace(self, steps):
        """The recorded execution order: one collection of tensor names per unit run."""
        with self._core.lock:
            traces.set_trace(self._core, steps, self.owner)

    def at(self, position):
        with self._core.lock:
            self._core.policy.advance(position, self.owner)

    def resynced(self):
        with self._core.lock:
            self._core.stats.trace_resyncs += 1

    @property
    def high_watermark(self):
        return self._core.memory.high
