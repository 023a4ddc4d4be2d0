"""The compute session: what the layer hooks call per unit, in one place.

One session per offloaded model (its `owner` keys its trace in the policy).
Per unit: `acquire(records)` before compute (wait, pin, bind; returns the
stall), `release(records, output)` after (a compute fence behind the unit's
kernels, then unpin), `at(position)` to tell the policy where compute is.
"""


class ComputeSession:
    def __init__(self, daemon, owner):
        self._daemon = daemon
        self.owner = owner
        self.marker = daemon.compute_marker()   # per-unit compute fences, or None

    def acquire(self, records, *, auto_fetch=True):
        """Pin and bind for compute; returns stall seconds. With auto_fetch=False,
        a unit neither resident nor on its way raises NotResidentError."""
        return self._daemon.acquire(records, auto_fetch=auto_fetch)

    def release(self, records, output=None):
        """Compute that read `records` was dispatched: fence it, then unpin."""
        if self.marker is not None and output is not None:
            self._daemon.compute_done(records, self.marker.mark(output))
        self._daemon.unpin(records)

    def prefetch(self, records, priority=0):
        return self._daemon.prefetch(records, priority=priority)

    def set_trace(self, steps):
        self._daemon.set_trace(steps, owner=self.owner)

    def at(self, position):
        self._daemon.advance_trace(position, owner=self.owner)

    def resynced(self):
        self._daemon.note_resync()

    @property
    def high_watermark(self):
        return self._daemon.status_watermark()
