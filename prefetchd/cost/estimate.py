"""The predicted pass time of one offloaded model, and with lookahead="auto" its lookahead.

The layer hooks (prefetchd/hooks/offload.py) call it at pass boundaries; nothing here
pins or moves a tensor:

    estimator.recording_started(marker, stall_seconds)   # recording pass, root pinned
    estimator.time_unit(marker, name, output, ...)       # after each unit of that pass (or
    estimator.released(name, epoch, dispatched_ns)       #   released, behind the unit's own fence)
    estimator.recorded(units, root, tier, ...)           # its end: the cost model's plan
    estimator.recording_abandoned()                      # ... or it raised: the next pass records
    estimator.released(name, epoch, dispatched_ns)       # later passes, while refining
    estimator.streamed()                                 # after each later pass: refined
    estimator.close()

The recording pass times each unit alone (prefetchd.cost.recording); the cost model
(prefetchd.cost.model) plans from those timings and the measured transfer rates. The
next passes refine the rates and the compute (prefetchd.cost.refine): while the
estimate is refined, a FenceClock thread notes when compute reaches each unit's
release fence (the fences the hooks mark anyway; nothing waits for them), and
a pass whose fences were all reached by the end of this or the next pass gives
its units' compute. An estimate that cannot be made is logged and skipped: it
never breaks the user's forward.
"""
import logging
import statistics
import weakref

from . import model as cost_model
from ..backend.base import checksum_rate, copy_rate
from .fence_clock import FenceClock
from .recording import RecordingTimer, unit_kind
from .refine import Refinement

log = logging.getLogger("prefetchd.hooks")


class PassEstimator:
    """`estimate` (a cost.model.Schedule, or None) and `lookahead`: the one asked for, or with
    auto=True the plan's once there is one."""

    def __init__(self, daemon, lookahead, auto):
        self.daemon = daemon
        self.lookahead = lookahead
        self.auto = auto
        self.estimate = None
        self._timer = None           # RecordingTimer while the recording pass runs
        self._refinement = None      # refine.Refinement while the streamed passes' figures settle
        self._marker = None          # the compute marker the fences are marked on
        self._units = ()             # (name, kind) per unit, trace order (the root excluded)
        self._clock = None           # FenceClock of a streamed pass (sealed once it ended),
        self._clock_names = []       # and the units it timed

    def recording_started(self, marker, stall_seconds):
        """The recording pass pinned its root. Without a compute marker nothing is timed."""
        if marker is None:
            return
        self._marker = marker
        if self._timer is None:
            self._timer = RecordingTimer(marker)
        self._timer.pass_started(stall_seconds)

    def recording_abandoned(self):
        """The recording pass raised: its timings are dropped, and the next pass (which records
        the trace again) is timed afresh. Mixing the two gave unit counts that matched nothing."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.close()

    def released(self, name, epoch, dispatched_ns):
        """A unit was released behind fence `epoch`; dispatched_ns None: the root. In the
        recording pass this waits for the unit's compute; later nothing waits."""
        if epoch is None:
            return
        if self._timer is not None:
            self._timer.released(name, epoch, dispatched_ns)
        elif dispatched_ns is not None and self._refinement is not None and self._marker is not None:
            if self._clock is None:
                # Timing ends with the daemon, or with this estimator (its model dropped unclosed).
                daemon, me = self.daemon, weakref.ref(self)
                self._clock, self._clock_names = FenceClock(
                    self._marker, alive=lambda: not daemon.closed and me() is not None), []
            if not self._clock.sealed:
                self._clock.unit(epoch, dispatched_ns)
                self._clock_names.append(name)

    def time_unit(self, marker, name, output, dispatched_ns):
        """Recording pass: a fence behind `output` (a unit's), and wait for it (released).
        False, timing nothing, without a compute marker or an output to fence."""
        if marker is None or output is None:
            return False
        self.released(name, marker.mark(output), dispatched_ns)
        return True

    def recorded(self, units, root_bytes, tier, stall_seconds, high_watermark):
        """The recording pass ended; `units` in trace order (the root excluded)."""
        timer, self._timer = self._timer, None
        if timer is None:
            return
        try:
            self._estimate_from(timer, units, root_bytes, tier, stall_seconds, high_watermark)
        finally:                # (after stop(), a no-op; a Ctrl-C before it left its thread waiting)
            timer.close()

    def _estimate_from(self, timer, units, root_bytes, tier, stall_seconds, high_watermark):
        self._units = tuple((u.name, unit_kind(u.cells, u.params)) for u in units)
        backend = self.daemon.backend
        contended = bool(backend.copy_contention)
        try:
            inputs = timer.inputs(
                [u.nbytes for u in units], [unit_kind(u.cells, u.params) for u in units], stall_seconds,
                stats=self.daemon.snapshot()[1], high_watermark=high_watermark,
                # Copies on compute's cores run at a copy's own rate (the recording pass's are
                # first touches of fresh device memory, several times slower).
                h2d_rate=copy_rate() if contended else None,
                host_budget=self.daemon.config.host_budget, root_bytes=root_bytes, tier=tier,
                copy_contention=backend.copy_contention,
                checksum_rate=checksum_rate(),
                # ...and compute is charged for them at that rate (plan.Inputs.copy_cpu_rate).
                copy_cpu_rate=copy_rate() if contended else 0.0)
            self._adopt(cost_model.plan(inputs, None if self.auto else self.lookahead),
                        "rates and compute of the recording pass")
        except (TimeoutError, ValueError) as e:
            log.info("prefetchd.offload: no pass-time estimate (%s)", e)
            return
        self._refinement = Refinement(inputs, self.daemon.snapshot()[1])

    def streamed(self):
        """A streamed pass ended: the plan again with its transfer rates and, once a timed pass's
        fences were reached, its compute; until they settle."""
        if self._clock is not None:
            self._clock.seal()           # its thread ends once compute reached the pass's fences
        refinement, self._refinement = self._refinement, None
        if refinement is None:
            return
        compute = self._timed_compute()
        try:
            refined, following = refinement.step(self.daemon.snapshot()[1], compute)
            if refined is not None:
                self._adopt(cost_model.plan(refined, None if self.auto else self.lookahead),
                            "rates of the last streamed pass" +
                            ("; compute timed in a streamed pass" if compute is not None else ""))
        except ValueError as e:      # never break the user's forward over an estimate
            log.info("prefetchd.offload: the estimate was not refined (%s)", e)
            self.close()
            return
        self._refinement = following
        if following is None:
            self.close()

    def _timed_compute(self):
        """Per-unit compute seconds (trace order) of the timed pass once compute reached all
        its fences, else None (tried again after the next pass). None, too, for a pass that
        ran other units than the trace's, or not in its order (a resync). The units are timed
        as they are released, and a unit whose cells run apart (an embedding's positions and
        a final norm, pinned from the first to the last) is released after the ones between:
        its order is the one its kernels were dispatched in (the pass was never timed)."""
        clock = self._clock
        if clock is None or not clock.reached():
            return None
        self._clock, names = None, self._clock_names
        dispatch_ns, fence_ns = clock.stop()
        trace = tuple(name for name, _ in self._units)
        if tuple(name for _, name in sorted(zip(dispatch_ns, names))) != trace:
            return None
        timed = dict(zip(names, cost_model.compute_seconds_from_fences(dispatch_ns, fence_ns)))
        seconds = [timed[name] for name in trace]
        # The mean of a kind, not its median: a pipelined pass has no one-off costs to drop,
        # and fences passed together give one unit its neighbours' time (the sum is right).
        return cost_model.pooled(seconds, [kind for _, kind in self._units], statistic=statistics.fmean)

    def close(self):
        """Stop timing (the handle closed, or the estimate settled)."""
        clock, self._clock = self._clock, None
        if clock is not None:
            clock.close()
        self.recording_abandoned()

    def _adopt(self, estimate, source):
        self.estimate = estimate
        if self.auto:
            self.lookahead = estimate.lookahead
        log.info("prefetchd.offload: lookahead %d%s; predicted %.3f s per pass (%s-bound; compute %.3f s, "
                 "copies %.3f s, of which disk %.3f s; %s)", self.lookahead,
                 " (auto)" if self.auto else "", estimate.pass_seconds, estimate.bound, estimate.compute_seconds,
                 estimate.io_seconds, estimate.disk_seconds, source)
