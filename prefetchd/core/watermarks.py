"""set_watermarks: a change is in force once the device tier is under it.

Lowering the high watermark below the bytes in use evicts down to the new low
watermark, and dirty victims are written back before their blocks are freed, so the
bytes in use fall over several scheduler steps. Until they are under the new high
watermark the old watermarks stay in force: status and metrics report them, so the
bytes reserved never exceed the high watermark reported (what the watermark alert
checks: it fired on an ordinary lowering), while new reservations already keep to
the new one. The request resolves once the new watermarks are in force. If they
cannot be (nothing in flight is left to free bytes: a write-back failed, compute
pinned tensors since), it fails with BudgetError naming what holds the bytes, and
the old watermarks stay. A change made while one is under way replaces its watermarks, and
the earlier request settles with it (resolved, or failed, with the later one).

Scheduler thread only, under the daemon's lock.
"""
from ..errors import BudgetError


class WatermarkChanges:
    def __init__(self, memory, outcomes, transfers):
        self._memory = memory
        self._outcomes = outcomes
        self._transfers = transfers        # truthy while any transfer is in flight
        self._pending = None               # ([requests], the (high, low) in force before the first)

    def start(self, req):
        """Handle a WATERMARKS request: args (high, low) in bytes."""
        high, low = req.args
        memory = self._memory
        pinned = memory.pinned_bytes()
        if high < pinned:
            self._outcomes.fail(req, BudgetError(
                f"high watermark {high} bytes is below the {pinned} bytes pinned by compute"))
            return
        waiting, before = self._pending if self._pending is not None else ([], memory.in_force)
        memory.high, memory.low = high, low      # new reservations keep to these from now on
        self._pending = (waiting + [req], before)
        memory.make_room(0, demand=True)
        self.settle()

    def settle(self):
        """After every scheduler step: put a pending change in force once the bytes in use
        are under it; fail it once nothing in flight can get them there."""
        if self._pending is None:
            return
        memory = self._memory
        if memory.used() > memory.high and not self._transfers and not memory.unfenced:
            memory.make_room(0, demand=True)     # victims freed up since (an unpin)
        if memory.used() <= memory.high:
            waiting, _ = self._pending
            self._pending = None
            memory.in_force = (memory.high, memory.low)
            for req in waiting:
                self._outcomes.resolve(req)
        elif not self._transfers and not memory.unfenced:
            waiting, (high, low) = self._pending
            self._pending = None
            error = BudgetError(
                f"high watermark {memory.high} bytes cannot be reached: {memory.used()} bytes stay in use "
                f"({memory.pinned_bytes()} pinned{memory.held_by_failed_writebacks()}); the "
                f"watermarks stay at high {high}, low {low} bytes")
            memory.high, memory.low = high, low
            for req in waiting:
                self._outcomes.fail(req, error)

    def cancel(self, error):
        if self._pending is not None:
            waiting, _ = self._pending
            self._pending = None
            for req in waiting:
                self._outcomes.fail(req, error)

