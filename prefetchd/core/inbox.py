"""The scheduler's inbox: where any thread's requests wait for the scheduler thread.

`submit` numbers a request and queues it in one round of the daemon's lock, then
wakes the scheduler (the backend's completion queue) if the inbox was empty; the
scheduler thread pops every queued request, in that order, each time it wakes. Once the daemon is closing, `refuse_new` makes `submit`
raise; the shutdown sentinel itself is never refused.
"""
import collections
import itertools

from ..errors import ShutdownError
from .requests import Kind, Request


class Inbox(collections.deque):
    """A deque of Requests (the scheduler pops from the left) with the any-thread entry."""

    def __init__(self, lock, backend):
        super().__init__()
        self._lock = lock
        self._backend = backend
        self._seq = itertools.count()
        self._refusal = None           # why new requests are refused (the daemon is closing)

    def submit(self, request):
        """Queue `request`; returns its future (None for an unpin). One lock round, whatever
        its number of tensors: requests are handled in the order they were numbered."""
        with self._lock:
            if self._refusal is not None:
                raise ShutdownError(self._refusal)
            request.seq = next(self._seq)
            wake = not self
            self.append(request)
        # The scheduler drains the whole inbox under the lock each time it wakes, so only
        # the request that found it empty needs to wake it: the ones behind it are taken
        # with it (each notify is one more wake-up, ~0.1 ms of the scheduler's CPU).
        if wake:
            self._backend.notify()
        return request.future

    def next_seq(self):
        return next(self._seq)

    @property
    def accepting(self):
        """Whether `submit` takes new requests (the daemon is not closing)."""
        return self._refusal is None

    def refuse_new(self, reason):
        """From now on `submit` raises ShutdownError(reason). Call under the lock."""
        self._refusal = reason

    def shut_down(self, deadline):
        """Queue the sentinel that stops the loop by `deadline` (monotonic seconds): write-backs
        that can finish by then do, the rest are cancelled. Not refused; safe to repeat."""
        self.append(Request(Kind.SHUTDOWN, args=deadline))
        self._backend.notify()
