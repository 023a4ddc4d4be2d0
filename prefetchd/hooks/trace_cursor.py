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
text runs the encoder (alone, or with the decoder) once, then the decoder for every
further token, its first step computing the cross-attention keys that later steps
take from the cache. One trace fits no kind: each switch of kind missed most units
and adopted another order, twice per generate call. So the cursor keeps each order it
adopted (`MAX_ORDERS` of them, the least recently used goes): a pass that leaves the
trace where another known order, alike so far, goes on with the unit starting follows
that order (no resync), and at a pass end the trace becomes the order that most often
followed passes of this kind (the known order it ran, if any), so the next pass's
first units are prefetched. Pure bookkeeping, no I/O and no pinning: the layer hooks
(prefetchd/hooks/offload.py) prefetch what `upcoming` names and publish `steps` to
the eviction policy whenever they change (`end_pass` True, or `switched`).
"""
ROOT = -1        # the root unit's step in the trace
MAX_ORDERS = 8   # orders kept per model; the least recently used goes first


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
        self._orders = {}        # tuple(order) -> order: those adopted, least recently used first
        self._follows = {}       # (kind of a pass, kind of the next) -> times seen; a kind is
                                 # the tuple of the known order it ran, None if none
        self._previous = None    # the kind of the pass before

    @property
    def open(self):
        """Whether a later pass started and has not ended (end_pass, abandon_pass)."""
        return self._open

    def start_pass(self):
        self.position = 0
        if not self._orders:     # the first pass after the recording one, which ran the trace
            self._previous = tuple(self.steps)
        self._keep(self.steps)
        self._seen = [ROOT]
        self._new = False
        self._open = True

    def start_recording(self):
        """The pass started is the recording pass: its steps are the trace (record)."""
        self.steps = [ROOT]
        self._open = False
        self._orders.clear()
        self._follows.clear()

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
        return self._predict(tuple(seen)) or retraced

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
        self.switched = False
        steps, n = self.steps, len(self.steps)
        if self.position + 1 < n and steps[self.position + 1] == index:
            self._seen.append(index)
            self.position += 1
            return True
        other = self._going_on(index)
        self._seen.append(index)
        if other is not None:        # a pass of another kind: follow its order
            self.steps, self.position, self.switched = other, len(self._seen) - 1, True
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

    def _going_on(self, index):
        """A known order other than the trace that this pass has run alike so far and that
        goes on with unit `index`, the most recently used; or None."""
        seen, at = self._seen, len(self._seen)
        for order in reversed(self._orders.values()):
            if order is not self.steps and len(order) > at and order[at] == index and order[:at] == seen:
                return order
        return None

    def _keep(self, steps):
        """Keep `steps`, an order adopted, as the most recently used."""
        if len(steps) < 2:
            return
        key = tuple(steps)
        self._orders.pop(key, None)
        self._orders[key] = steps
        if len(self._orders) > MAX_ORDERS:
            del self._orders[next(iter(self._orders))]

    def _predict(self, seen):
        """After a pass that ran `seen`: count which kind of pass followed which, and make the
        trace the order most often seen after passes of this kind (True if that changed it).
        A pass that ran no known order guesses nothing."""
        kind = seen if seen in self._orders else None
        if self._previous is not None and kind is not None:
            key = (self._previous, kind)
            self._follows[key] = self._follows.get(key, 0) + 1
            if len(self._follows) > MAX_ORDERS * MAX_ORDERS:   # kinds that come and go
                self._follows = {key: 1}
        self._previous = kind
        counts = [(n, i, after) for i, ((before, after), n) in enumerate(self._follows.items())
                  if before == kind and after in self._orders]   # (no key's `before` is None)
        if not counts:
            return False
        order = self._orders[max(counts)[2]]
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
