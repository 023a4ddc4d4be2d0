"""Jobs by deadline: what answers a request TIMEOUT if nothing else does first.
Used on the front's I/O thread only."""
import heapq
import itertools


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

    def waiting_connections(self):
        """Descriptors of the client connections with a job not yet answered."""
        return {job.fd for _, _, job in self._heap if not job.done}
