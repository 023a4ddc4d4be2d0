"""Where a pass is in its model's recorded trace, and which units come next.

The trace is the order of one pass: ROOT, then the index of each unit as it
started in the recording pass (a unit may appear several times). Later passes
move the cursor as units start; a unit other than the expected one (an early
exit, a skipped layer, another branch) re-synchronises to its nearest
occurrence ahead and is counted. A pass that ran a unit the trace does not
hold (an MoE expert the recording pass did not route to, a branch taken
since) becomes the trace (`end_pass`), so the next pass prefetches it; a pass
that only skipped or reordered units (an early exit) leaves the trace as it was,
unless the pass before it ran in that same order: a lasting change (a block
dropped or two swapped for good) missed on every pass, for good. A pass that
raised part-way (`abandon_pass`: strict=True's miss at the first unit out of
order) counts as its order so far, then the trace's from there. Pure
bookkeeping, no I/O and no pinning: the layer hooks (prefetchd/hooks/offload.py)
prefetch what `upcoming` names.
"""
ROOT = -1        # the root unit's step in the trace


class TraceCursor:
    def __init__(self):
        self.steps = []          # ROOT, then unit indices in execution order
        self.position = 0        # index into steps of the step running now
        self.resyncs = 0         # starts that were not the expected next step
        self.retraces = 0        # passes that became the trace (end_pass)
        self._seen = []          # this pass's steps so far
        self._last = None        # the steps of the pass before, once ended
        self._new = False        # this pass ran a unit the trace does not hold
        self._open = False       # a later pass started and has not ended

    def start_pass(self):
        self.position = 0
        self._seen = [ROOT]
        self._new = False
        self._open = True

    def start_recording(self):
        """The pass started is the recording pass: its steps are the trace (record)."""
        self.steps = [ROOT]
        self._open = False

    def record(self, index):
        """Recording pass: `index` started."""
        self.steps.append(index)

    def end_pass(self):
        """A later pass ended. True if it ran a unit the trace did not hold, or ran in an order
        other than the trace's twice in a row: its order is the trace from now on."""
        self._open = False
        seen, last, self._last = self._seen, self._last, self._seen
        if not self._new and (seen == self.steps or seen != last):
            return False
        self.steps = seen
        self.retraces += 1
        self._new = False
        return True

    def abandon_pass(self):
        """A later pass raised part-way; end_pass's answer for its order so far followed by
        the trace's from where it stopped (False if no pass is open). Else a lasting change
        that strict=True's miss cuts short at the same unit on every pass is never adopted,
        and every pass raises there, for good."""
        if not self._open:
            return False
        self._seen += self.steps[self.position + 1:]
        return self.end_pass()

    def enter(self, index):
        """A later pass: unit `index` starts. False when it was not the expected next step
        (the position moved to its nearest occurrence ahead, or stayed where it was for a
        unit the trace never saw)."""
        self._seen.append(index)
        steps, n = self.steps, len(self.steps)
        if self.position + 1 < n and steps[self.position + 1] == index:
            self.position += 1
            return True
        self.resyncs += 1
        for step in range(1, n + 1):
            pos = (self.position + step) % n
            if steps[pos] == index:
                self.position = pos
                break
        else:
            self._new = True
        return False

    def upcoming(self, start):
        """Unit indices from step `start` on, wrapping into the next pass, one pass at most;
        the root is skipped (pinned for a whole pass, prefetched at its end)."""
        n = len(self.steps)
        for step in range(n):
            index = self.steps[(start + step) % n]
            if index != ROOT:
                yield index
