"""Which unleased block of the shared host tier to drop first.

Each attached process may send its trace: the order in which it loads tensors
(one pass, repeated). The owner follows every trace with a cursor (the position
of the last tensor that process acquired) and ranks blocks by Belady's rule on
the union of the traces: the block whose next use by *any* attached process is
farthest goes first. Blocks no trace mentions go before traced ones, oldest use
first (LRU); without any trace the ranking is plain LRU.
"""
import bisect

INF = float("inf")


class Trace:
    """One process' load order and where it is in it."""

    def __init__(self, names):
        self.length = len(names)
        self.positions = {}
        for i, name in enumerate(names):
            self.positions.setdefault(name, []).append(i)
        self.cursor = -1

    def advance(self, name):
        """`name` was just loaded: move the cursor to its next occurrence."""
        at = self.positions.get(name)
        if at:
            i = bisect.bisect_right(at, self.cursor)
            self.cursor = at[i] if i < len(at) else at[0]

    def distance(self, name):
        """Loads until `name` is used again by this process (INF if never)."""
        at = self.positions.get(name)
        if not at:
            return INF
        i = bisect.bisect_right(at, self.cursor)
        return at[i] - self.cursor if i < len(at) else at[0] + self.length - self.cursor


def next_use(name, traces):
    return min((t.distance(name) for t in traces), default=INF)


def rank(blocks, traces):
    """blocks (objects with .key and .last_use): best victim first."""
    traces = list(traces)
    return sorted(blocks, key=lambda b: (-next_use(b.key, traces), b.last_use))
