"""The predicted pass time of one offloaded model, and with lookahead="auto" its lookahead.

The layer hooks (prefetchd/hooks.py) call it at pass boundaries; nothing here
pins or moves a tensor:

    estimator.recording_started(marker, stall_seconds)   # recording pass, root pinned
    estimator.released(name, epoch, dispatched_ns)       # after each unit of that pass
    estimator.recorded(units, root, tier, ...)           # its end: the cost model's plan
    estimator.streamed()                                 # after each later pass: refined

The recording pass times each unit alone (prefetchd.recording); the cost model
(prefetchd.plan) plans from those timings and the measured transfer rates; the
next passes refine the rates (prefetchd.refine). An estimate that cannot be
made is logged and skipped: it never breaks the user's forward.
"""
import logging

from . import plan as cost_model
from .backend.base import checksum_rate, copy_rate
from .recording import RecordingTimer, unit_kind
from .refine import Refinement

log = logging.getLogger("prefetchd.hooks")


class PassEstimator:
    """`estimate` (a plan.Plan, or None) and `lookahead`: the one asked for, or with
    auto=True the plan's once there is one."""

    def __init__(self, daemon, lookahead, auto):
        self.daemon = daemon
        self.lookahead = lookahead
        self.auto = auto
        self.estimate = None
        self._timer = None           # RecordingTimer while the recording pass runs
        self._refinement = None      # refine.Refinement while the streamed passes' rates settle

    def recording_started(self, marker, stall_seconds):
        """The recording pass pinned its root. Without a compute marker nothing is timed."""
        if marker is None:
            return
        if self._timer is None:
            self._timer = RecordingTimer(marker)
        self._timer.pass_started(stall_seconds)

    def released(self, name, epoch, dispatched_ns):
        """A unit of the recording pass was released behind fence `epoch` (waits for its compute)."""
        if self._timer is not None and epoch is not None:
            self._timer.released(name, epoch, dispatched_ns)

    def recorded(self, units, root_bytes, tier, stall_seconds, high_watermark):
        """The recording pass ended; `units` in trace order (the root excluded)."""
        timer, self._timer = self._timer, None
        if timer is None:
            return
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
            self._adopt(cost_model.plan(inputs, None if self.auto else self.lookahead), "recording pass")
        except (TimeoutError, ValueError) as e:
            log.info("prefetchd.offload: no pass-time estimate (%s)", e)
            return
        self._refinement = Refinement(inputs, self.daemon.snapshot()[1])

    def streamed(self):
        """A streamed pass ended: the plan again with its transfer rates, until they settle."""
        refinement, self._refinement = self._refinement, None
        if refinement is None:
            return
        try:
            refined, following = refinement.step(self.daemon.snapshot()[1])
            if refined is not None:
                self._adopt(cost_model.plan(refined, None if self.auto else self.lookahead),
                            "last streamed pass")
        except ValueError as e:      # never break the user's forward over an estimate
            log.info("prefetchd.offload: the estimate was not refined (%s)", e)
            return
        self._refinement = following

    def _adopt(self, estimate, source):
        self.estimate = estimate
        if self.auto:
            self.lookahead = estimate.lookahead
        log.info("prefetchd.offload: lookahead %d%s; predicted %.3f s per pass (%s-bound; compute %.3f s, "
                 "copies %.3f s, of which disk %.3f s; rates of the %s)", self.lookahead,
                 " (auto)" if self.auto else "", estimate.pass_seconds, estimate.bound, estimate.compute_seconds,
                 estimate.io_seconds, estimate.disk_seconds, source)
