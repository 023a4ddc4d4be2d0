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
order) counts as its order so far, then the trace's from there.

Some models run passes of several kinds in a pattern: an encoder-decoder generating
text runs the encoder and the decoder once, then the decoder alone for every further
token. One trace fits neither kind: each switch of kind missed most units and adopted
the other order, twice per generate call. So the cursor keeps each order it adopted,
keyed by the unit its passes begin with (`MAX_ORDERS` of them): a pass whose first
unit begins another known order follows that order (no resync), and at a pass end
the trace becomes the order that most often followed passes like this one, so the
next pass's first units are prefetched. Models whose passes all begin alike keep one
order, as before. Pure bookkeeping, no I/O and no pinning: the layer hooks
(prefetchd/hooks/offload.py) prefetch what `upcoming` names and publish `steps` to
the eviction policy whenever they change (`end_pass` True, or `switched`).
"""
ROOT = -1        # the root unit's step in the trace
MAX_ORDERS = 8   # orders kept per model, by first unit; the oldest goes first


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
        self.switched = False    # the last enter() moved to another known order
        self._orders = {}        # first unit -> the order adopted for passes beginning with it
        self._follows = {}       # (first unit of a pass, first unit of the next) -> times seen
        self._previous = None    # the first unit of the pass before

    def start_pass(self):
        self.position = 0
        self._seen = [ROOT]
        self._new = False
        self._open = True
        self._keep(self.steps)
        if self._previous is None and len(self.steps) > 1:
            self._previous = self.steps[1]      # the recording pass's kind

    def start_recording(self):
        """The pass started is the recording pass: its steps are the trace (record)."""
        self.steps = [ROOT]
        self._open = False
        self._orders.clear()
        self._follows.clear()
        self._previous = None

    def record(self, index):
        """Recording pass: `index` started."""
        self.steps.append(index)

    def end_pass(self):
        """A later pass ended. True if it ran a unit the trace did not hold, or ran in an order
        other than the trace's twice in a row: its order is the trace from now on."""
        self._open = False
        seen, last, self._last = self._seen, self._last, self._seen
        retraced = self._new or (seen != self.steps and seen == last)
        if retraced:
            self.steps = seen
            self.retraces += 1
            self._new = False
            self._keep(seen)
        return self._predict(seen[1] if len(seen) > 1 else None) or retraced

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
        first = len(self._seen) == 1
        self._seen.append(index)
        self.switched = False
        steps, n = self.steps, len(self.steps)
        if self.position + 1 < n and steps[self.position + 1] == index:
            self.position += 1
            return True
        if first and self._orders.get(index, steps) is not steps:
            # A pass that begins like another order of this model: follow that one.
            self.steps, self.position, self.switched = self._orders[index], 1, True
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

    def _keep(self, steps):
        """Keep `steps`, an order adopted, for the passes that begin with its first unit."""
        if len(steps) < 2:
            return
        self._orders.pop(steps[1], None)
        self._orders[steps[1]] = steps
        if len(self._orders) > MAX_ORDERS:
            del self._orders[next(iter(self._orders))]

    def _predict(self, first):
        """After a pass that began with unit `first`: count which kind of pass followed which,
        and make the trace the order most often seen after passes like this one (True if
        that changed it). No guess without such a pass, nor from a pass that ran no unit."""
        if first is None:
            return False
        if self._previous is not None:
            key = (self._previous, first)
            self._follows[key] = self._follows.get(key, 0) + 1
            if len(self._follows) > MAX_ORDERS * MAX_ORDERS:   # firsts that come and go
                self._follows = {key: 1}
        self._previous = first
        counts = [(n, after) for (before, after), n in self._follows.items()
                  if before == first and after in self._orders]
        if not counts:
            return False
        order = self._orders[max(counts)[1]]
        if order is self.steps:
            return False
        self.steps = order
        return True

    def upcoming(self, start):
        """Unit indices from step `start` on, wrapping into the next pass, one pass at most;
        the root is skipped (pinned for a whole pass, prefetched at its end)."""
        n = len(self.steps)
        for step in range(n):
            index = self.steps[(start + step) % n]
            if index != ROOT:
                yield index
