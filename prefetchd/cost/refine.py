"""Refining a model's pass-time estimate with what its streamed passes measured.

The recording pass's estimate is a first guess on two counts:

- its copies are the first writes to fresh device memory (page faults; on a
  VM, the hypervisor backing each page), up to 10x slower than later ones;
- its units are timed one at a time, each launched from an idle op queue, so
  Python's dispatch of a unit's kernels (3-4 ms a Dense here) adds to that
  unit's compute instead of overlapping the previous unit's, and every load
  beside it is timed in: 1.3-1.8x the compute of a pipelined pass, measured
  (docs/performance.md, "compute from a streamed pass").

So after each streamed pass the plan is made again with that pass's transfer
rates and, where its units' compute fences were timed (prefetchd.cost.estimate),
with the compute it measured, until the figures settle (within SETTLED of the
last pass's) or PASSES passes. Compute measured in a streamed pass already
holds what the copies beside it took from compute's cores, so those inputs
charge copies nothing more (copy_contention 0) and take the copy stream's
rate as measured beside compute. The figures are settled once two timed
passes in a row agree.
Pure: numbers in, numbers out; the layer hooks (prefetchd/hooks/offload.py) plan and log.
"""
import dataclasses
from dataclasses import dataclass

from . import model as cost_model

PASSES = 5        # streamed passes whose measurements may refine the estimate
SETTLED = 0.10    # ... until they change by at most this fraction from one pass to the next


@dataclass(frozen=True)
class Refinement:
    """plan.Inputs to refine, and the daemon Stats snapshot taken when they were planned."""
    inputs: cost_model.Inputs
    since: object
    left: int = PASSES

    def step(self, now, compute=None):
        """After a streamed pass whose stats are `now` and, if timed, whose units computed for
        `compute` seconds each (trace order, as inputs.compute_seconds): (the refined Inputs,
        or None if the pass measured nothing; the Refinement for the next pass, or None once
        settled or out of passes). ValueError if the new figures make no valid Inputs."""
        disk, h2d = cost_model.rates_from_stats(now, since=self.since)
        old = self.inputs
        in_pass = compute is not None or not old.copy_contention
        if old.copy_cpu_rate and not in_pass:
            # Copies on compute's own cores (the cpu backend), compute timed alone: the
            # stream's rate in a pass is slowed by the compute beside it, which Inputs
            # charges to compute already (copy_contention). Keep the rate of a copy alone.
            h2d = None
        if disk is None and h2d is None and compute is None:
            # Nothing to refine from (a pass that moved nothing, compute not timed yet): the
            # next pass may have it, counted from the same snapshot.
            return None, (dataclasses.replace(self, left=self.left - 1) if self.left > 1 else None)
        changes = dict(disk_rate=disk or old.disk_rate, h2d_rate=h2d or old.h2d_rate)
        if compute is not None:
            changes.update(compute_seconds=tuple(compute), copy_contention=0.0, copy_cpu_rate=0.0)
        refined = dataclasses.replace(old, **changes)
        pairs = [(refined.disk_rate, old.disk_rate), (refined.h2d_rate, old.h2d_rate),
                 (sum(refined.compute_seconds), sum(old.compute_seconds))]
        # Settled only on a pass whose compute was timed too: its rates alone would leave the
        # recording pass's compute (or one timed pass's) unconfirmed.
        settled = compute is not None and all(abs(new / was - 1) <= SETTLED for new, was in pairs if was)
        following = None if settled or self.left <= 1 else Refinement(refined, now, self.left - 1)
        return refined, following
