"""Eviction order. A policy ranks eviction candidates; the scheduler takes them in order.

Adding a policy is one class here (or in a file of its own) decorated with
`@register("name")`; `Config.policy` picks it by name.
"""
import bisect
import operator

POLICIES = {}

_last_use = operator.attrgetter("last_use")   # a C key for the LRU sorts


def register(name):
    def wrap(cls):
        POLICIES[name] = cls
        cls.name = name
        return cls
    return wrap


def create(name):
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None


class Policy:
    """Interface. `rank` returns candidates best-victim first; it must not mutate them."""

    name = "base"
    traces_set = 0   # set_trace calls so far: what depends on the traces is recomputed when it moves

    def set_trace(self, steps, owner=None):
        """steps: collections of tensor names in execution order (one per unit) of `owner`'s model."""

    def single_use_steps(self):
        """Every trace whose tensors are each used once per pass, as its steps (lists of
        names, in execution order), one trace after another; [] without such a trace.
        What a host cache spreads its replicas over (core/spread.py)."""
        return []

    def advance(self, position, owner=None):
        """Compute of `owner`'s model has reached trace step `position`."""

    def rank(self, candidates):
        raise NotImplementedError

    def ranks_by_last_use(self):
        """True while `rank` is least recently used first and nothing else (then a caller
        may walk an index kept in that order instead of ranking every candidate)."""
        return False

    def rank_beyond(self, candidates, limit):
        """`rank`, keeping only the candidates next used more than `limit` steps from now."""
        return [r for r in self.rank(candidates) if self.distance(r.name) > limit]

    def knows(self, name):
        """True if the policy can say when `name` is next used."""
        return False

    def distance(self, name):
        """Trace steps until `name` is next used (inf if unknown)."""
        return float("inf")

    def reuse_distance(self, name):
        """Trace steps until `name` is used again after its next use (inf if unknown):
        what a cache filled now, for that next use, would have to keep it for."""
        return float("inf")


@register("lru")
class LruPolicy(Policy):
    """Least recently used first (records carry `last_use`, a monotonic tick)."""

    def rank(self, candidates):
        return sorted(candidates, key=_last_use)

    def ranks_by_last_use(self):
        return True


@register("belady")
class BeladyPolicy(Policy):
    """Farthest next use first, from recorded execution traces (Belady's MIN).

    Each trace is cyclic (the next forward pass repeats it) and belongs to an
    owner (one offloaded model), so several models on one daemon keep their
    own orders and positions. Tensors no trace mentions go first; ties, and
    the time before any trace, fall back to LRU.
    """

    def __init__(self):
        self._traces = {}     # owner -> [uses: name -> sorted positions, length, position]
        self._owner = {}      # name -> owner
        self._steps = {}      # owner -> its steps as lists of names

    def set_trace(self, steps, owner=None):
        uses = {}
        for i, names in enumerate(steps):
            for name in names:
                uses.setdefault(name, []).append(i)
                self._owner[name] = owner
        self._traces[owner] = [uses, len(steps), 0]
        self._steps[owner] = [list(names) for names in steps]
        self.traces_set += 1

    def single_use_steps(self):
        out = []
        for owner, steps in self._steps.items():
            uses = self._traces[owner][0]
            if all(len(positions) == 1 for positions in uses.values()):
                out.extend(steps)
        return out

    def advance(self, position, owner=None):
        trace = self._traces.get(owner)
        if trace is not None:
            trace[2] = position

    def knows(self, name):
        return name in self._owner

    def _uses(self, name):
        """(sorted positions of name's uses, trace length, current position), or None."""
        trace = self._traces.get(self._owner.get(name, object()))
        if trace is None:
            return None
        uses, length, position = trace
        positions = uses.get(name)
        return (positions, length, position) if positions else None

    def distance(self, name):
        found = self._uses(name)
        if found is None:
            return float("inf")
        positions, length, position = found
        i = bisect.bisect_right(positions, position)
        if i < len(positions):
            return positions[i] - position
        return positions[0] + length - position

    def reuse_distance(self, name):
        found = self._uses(name)
        if found is None:
            return float("inf")
        positions, length, position = found
        # The use being served is the first at or after `position` (the unit computing
        # now, or one prefetched ahead of it); the reuse is the one after that.
        n = len(positions)
        i = bisect.bisect_left(positions, position)
        k = i + 1
        return positions[k % n] + (k // n) * length - position

    def ranks_by_last_use(self):
        return not self._traces

    def rank(self, candidates):
        if not self._traces:
            return sorted(candidates, key=_last_use)
        return sorted(candidates, key=lambda r: (-self.distance(r.name), r.last_use))

    def rank_beyond(self, candidates, limit):
        # one distance per candidate (the scheduler asks this for every reservation)
        keyed = [(d, r) for r in candidates if (d := self.distance(r.name)) > limit]
        keyed.sort(key=lambda dr: (-dr[0], dr[1].last_use))
        return [r for _, r in keyed]
