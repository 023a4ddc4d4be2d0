"""Submitted requests, and how their futures are settled.

Any thread builds a Request and puts it in the scheduler's inbox; only the
scheduler thread touches it afterwards. Futures are never resolved under the
daemon's lock (a callback may call back into the daemon): the scheduler
collects `(request, error)` pairs in an Outcomes list while it holds the lock
and settles them after releasing it.
"""
import enum
import logging
import math
import numbers
import time
from concurrent.futures import InvalidStateError

import numpy as np

from .waits import RequestFuture

log = logging.getLogger("prefetchd")

DONE = RequestFuture()   # shared, already-resolved future for requests satisfied on the spot
DONE.set_result(None)


class Kind(str, enum.Enum):
    PREFETCH = "prefetch"
    PIN = "pin"
    UNPIN = "unpin"
    REGISTER = "register"
    EVICT = "evict"
    FLUSH = "flush"
    STAGE = "stage"
    WATERMARKS = "watermarks"
    FORGET = "forget"      # placed tensors a failed offload() gives up (core/placement.py)
    UNREGISTER = "unregister"   # evict, then forget (core/explicit.py)
    SHUTDOWN = "shutdown"


# Requests whose loads may evict tensors prefetched but not used yet: compute
# (or the user) is waiting on them now.
DEMAND = frozenset((Kind.PIN, Kind.REGISTER))


class Request:
    """One submitted request; `remaining` counts tensors not yet satisfied."""

    __slots__ = ("kind", "recs", "future", "priority", "deadline", "seq", "submitted", "remaining",
                 "pinned", "args", "demand")

    def __init__(self, kind, recs=(), future=None, priority=0, deadline=None, args=None):
        self.kind = Kind(kind)
        self.recs = recs
        self.future = future
        self.priority = priority
        self.deadline = deadline
        self.seq = 0
        self.submitted = time.monotonic()
        self.remaining = 0
        self.pinned = []           # records this request pinned (undone if it fails)
        self.args = args
        self.demand = self.kind in DEMAND

    @property
    def counted_as(self):
        """The op name under which metrics count this request."""
        return "fetch" if self.kind is Kind.PIN else self.kind.value


class Outcomes:
    """The requests settled during one scheduler iteration (scheduler thread only)."""

    def __init__(self, stats):
        self._stats = stats
        self.items = []            # (request, error or None)

    def resolve(self, req, error=None):
        self.items.append((req, error))

    def fail(self, req, error, outcome="failed"):
        """Fail req once: undo its pins, stop it waiting, count it as `outcome` ("failed", or
        "refused" for one the tensor's state forbids: see prefetchd.telemetry.stats)."""
        if req.future is None or req.future.done() or any(r is req for r, _ in self.items):
            return
        for rec in req.pinned:
            rec.pins -= 1
        req.pinned.clear()
        for rec in req.recs or ():
            if req in rec.waiters:
                rec.waiters.remove(req)
        self._stats.count(req.counted_as, outcome)
        log.info("prefetchd: %s refused: %s", req.kind.value, error)     # one line per refusal
        self.resolve(req, error)

    def fail_waiters(self, rec, error):
        waiters, rec.waiters = rec.waiters, []
        for req in waiters:
            self.fail(req, error)

    def take(self):
        items, self.items = self.items, []
        return items


def settle(req, error, unpin):
    """Resolve a request's future (outside the lock). A pin whose caller
    cancelled meanwhile is undone through `unpin`."""
    try:
        if error is None:
            req.future.set_result(None)
        else:
            req.future.set_exception(error)
    except InvalidStateError:    # cancelled by its caller meanwhile
        if req.pinned:
            unpin(req.pinned)


def _finite_number(x):
    """A real number (numpy's included), not a bool, finite as a float (10**400 is not)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        return False
    try:
        return math.isfinite(float(x))
    except OverflowError:
        return False


def _shown(x):
    return f"{type(x).__name__} {x!r}"[:80]


def check_priority(priority):
    if not _finite_number(priority):
        raise TypeError(f"priority must be a finite number, not {_shown(priority)}")


def check_deadline(deadline):
    if deadline is not None and not _finite_number(deadline):
        raise TypeError(f"deadline must be a time.monotonic() value in seconds or None, "
                        f"not {_shown(deadline)}")
