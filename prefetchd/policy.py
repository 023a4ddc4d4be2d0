"""Eviction order. A policy ranks eviction candidates; the scheduler takes them in order.

Adding a policy is one class here (or in a file of its own) decorated with
`@register("name")`; `Config.policy` picks it by name.
"""
import bisect

POLICIES = {}


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

    def set_trace(self, steps):
        """steps: list of collections of tensor names, in execution order (one entry per unit)."""

    def advance(self, position):
        """Compute has reached trace step `position`."""

    def rank(self, candidates):
        raise NotImplementedError

    def knows(self, name):
        """True if the policy can say when `name` is next used."""
        return False

    def distance(self, name):
        """Trace steps until `name` is next used (inf if unknown)."""
        return float("inf")


@register("lru")
class LruPolicy(Policy):
    """Least recently used first (records carry `last_use`, a monotonic tick)."""

    def rank(self, candidates):
        return sorted(candidates, key=lambda r: r.last_use)


@register("belady")
class BeladyPolicy(Policy):
    """Farthest next use first, from a recorded execution trace (Belady's MIN).

    The trace is cyclic (the next forward pass repeats it). Tensors the trace
    never mentions go first; ties and the time before any trace fall back to LRU.
    """

    def __init__(self):
        self._uses = {}       # name -> sorted trace positions
        self._length = 0
        self._position = 0

    def set_trace(self, steps):
        uses = {}
        for i, names in enumerate(steps):
            for name in names:
                uses.setdefault(name, []).append(i)
        self._uses, self._length, self._position = uses, len(steps), 0

    def advance(self, position):
        self._position = position

    def knows(self, name):
        return name in self._uses

    def distance(self, name):
        positions = self._uses.get(name)
        if not positions:
            return float("inf")
        i = bisect.bisect_right(positions, self._position)
        if i < len(positions):
            return positions[i] - self._position
        return positions[0] + self._length - self._position

    def rank(self, candidates):
        if not self._length:
            return sorted(candidates, key=lambda r: r.last_use)
        return sorted(candidates, key=lambda r: (-self.distance(r.name), r.last_use))
