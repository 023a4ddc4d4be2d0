"""Refining a model's pass-time estimate with the transfer rates of its streamed passes.

The recording pass's copies are the first writes to fresh device memory (page
faults; on a VM, the hypervisor backing each page), up to 10x slower than later
ones, so the estimate it gives is re-planned after each streamed pass with that
pass's rates, until they settle (within SETTLED of the last pass's) or PASSES
passes. Compute stays the recording pass's, timed with nothing beside it.
Pure: numbers in, numbers out; the layer hooks (prefetchd/hooks.py) plan and log.
"""
import dataclasses
from dataclasses import dataclass

from . import plan as cost_model

PASSES = 5        # streamed passes whose transfer rates may refine the estimate
SETTLED = 0.10    # ... until they change by at most this fraction from one pass to the next


@dataclass(frozen=True)
class Refinement:
    """plan.Inputs to refine, and the daemon Stats snapshot taken when they were planned."""
    inputs: cost_model.Inputs
    since: object
    left: int = PASSES

    def step(self, now):
        """After a streamed pass whose stats are `now`: (the refined Inputs, or None if the
        pass moved nothing; the Refinement for the next pass, or None once settled).
        ValueError if the new rates make no valid Inputs."""
        disk, h2d = cost_model.rates_from_stats(now, since=self.since)
        old = self.inputs
        if old.copy_cpu_rate:
            # Copies on compute's own cores (the cpu backend): the stream's rate in a pass
            # is slowed by the compute beside it, which Inputs charges to compute already
            # (copy_contention). Keep the rate of a copy alone.
            h2d = None
        if disk is None and h2d is None:
            return None, None
        refined = dataclasses.replace(old, disk_rate=disk or old.disk_rate, h2d_rate=h2d or old.h2d_rate)
        settled = all(abs(new / was - 1) <= SETTLED for new, was in
                      ((refined.disk_rate, old.disk_rate), (refined.h2d_rate, old.h2d_rate)) if was)
        following = None if settled or self.left <= 1 else Refinement(refined, now, self.left - 1)
        return refined, following
