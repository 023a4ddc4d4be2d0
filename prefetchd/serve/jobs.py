"""The front's inference requests: a Job from the moment the front accepts it
until it is answered, and the deadlines that answer it TIMEOUT if nothing else
does first. Used on the front's I/O thread only."""
import heapq
import itertools
from dataclasses import dataclass

from ..control.codes import BadArguments


@dataclass
class Job:
    envelope: list
    rid: bytes
    model: str
    body: dict
    hint: bool
    deadline: float
    received: float
    worker: object = None        # the WorkerSlot running it; None while queued
    job_id: bytes = b""
    hinted: bool = False


def model_name(key, value):
    """The `model` argument of infer (prefetchd.control.ops validator)."""
    if not isinstance(value, str):
        raise BadArguments(f"'{key}' must be a model name")
    return value


class Deadlines:
    """Jobs by deadline. A job answered before its deadline stays here until then:
    the caller checks whether it is still waiting (cheaper than removing it)."""

    def __init__(self):
        self._heap = []
        self._order = itertools.count()      # ties: jobs never compare with each other

    def add(self, job):
        heapq.heappush(self._heap, (job.deadline, next(self._order), job))

    def nearest(self):
        return self._heap[0][0] if self._heap else None

    def expired(self, now):
        """Pop and yield the jobs whose deadline is `now` or earlier."""
        while self._heap and self._heap[0][0] <= now:
            yield heapq.heappop(self._heap)[2]
