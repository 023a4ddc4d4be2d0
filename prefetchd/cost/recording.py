"""Timing a model's recording pass for the cost model (prefetchd.cost.model).

The layer hooks (prefetchd/hooks/offload.py) record the trace on a model's first
forward; a RecordingTimer times that pass so the plan can predict later ones:

    timer = RecordingTimer(marker)                  # the daemon's compute marker
    timer.pass_started(stall_seconds)               # after the root unit was pinned
    timer.released(name, epoch, dispatched_ns)      # after each unit; dispatched_ns=None: the root
    inputs = timer.inputs(unit_bytes, unit_kinds, stall_seconds, **plan.measure arguments)

- Each unit runs alone: `released` waits for the unit's compute fence, so the
  hooks load the next unit only after it computed, and its compute is timed with
  no copy on the same cores beside it (the plan adds copies back per
  copy_contention; they would count twice otherwise). A unit computing for over
  FENCE_WAIT_S ends the waiting for the rest of the pass.
- The root's compute (embeddings, a head, and the Python between units) is the
  pass, from the root's pin to the output's fence, less the units' compute and
  the waits for their weights.
- Units of one kind (`unit_kind`: cell types and parameter shapes) get their
  kind's median compute (plan.pooled), which drops one-off costs such as the
  framework's first call at a shape.
"""
import logging
import time

from . import model as plan
from .fence_clock import FenceClock

log = logging.getLogger("prefetchd.hooks")

FENCE_WAIT_S = 30.0     # longest the recording pass waits for one unit's compute


def unit_kind(cells, params):
    """What makes two units' compute the same: their cell types and parameter shapes."""
    return (tuple(type(cell).__name__ for cell in cells),
            tuple((tuple(p.shape), str(p.dtype)) for p in params))


class RecordingTimer:
    def __init__(self, marker):
        self._marker = marker
        self._clock = FenceClock(marker)
        self._serial = True       # waiting for each unit's fence
        self._start = (0, 0.0)    # (ns after the root's pin, stall seconds then)
        self._end_ns = None       # when the output's fence was reached

    def close(self):
        """Stop timing without waiting (a recording pass that raised, or a closed handle)."""
        self._clock.close()

    def pass_started(self, stall_seconds):
        self._start = (time.monotonic_ns(), stall_seconds)
        self._end_ns = None

    def released(self, name, epoch, dispatched_ns=None):
        """A unit's kernels were dispatched (at dispatched_ns) and its fence marked at
        `epoch`; for the root (dispatched_ns None) the fence is behind the output."""
        if dispatched_ns is not None:
            self._clock.unit(epoch, dispatched_ns)
        if not self._serial:
            return
        if self._marker.wait(epoch, FENCE_WAIT_S) < epoch:
            self._serial = False
            log.info("prefetchd.offload: unit %r computed for over %.0f s; the rest of the recording "
                     "pass overlaps loads with compute", name, FENCE_WAIT_S)
        elif dispatched_ns is None:
            self._end_ns = time.monotonic_ns()

    def inputs(self, unit_bytes, unit_kinds, stall_seconds, **measured):
        """plan.Inputs of the pass (`measured`: plan.measure's keyword arguments).
        Raises TimeoutError if compute never reached some unit's fence."""
        dispatch_ns, fence_ns = self._clock.stop()
        root = self._root_seconds(plan.compute_seconds_from_fences(dispatch_ns, fence_ns), stall_seconds)
        return plan.measure(unit_bytes, dispatch_ns, fence_ns, unit_kinds=unit_kinds, root_seconds=root,
                            **measured)

    def _root_seconds(self, unit_seconds, stall_seconds):
        """0 where the pass end was not timed (the waiting stopped early)."""
        if self._end_ns is None:
            return 0.0
        start_ns, stall_before = self._start
        stalled = stall_seconds - stall_before
        return max(0.0, (self._end_ns - start_ns) / 1e9 - sum(unit_seconds) - stalled)
