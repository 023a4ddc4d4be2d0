"""Waits that the scheduler thread must never make.

Only a daemon's scheduler thread settles its requests' futures, and that thread also
runs future callbacks and listeners. A wait there for a future it has not settled yet
blocks the only thread that could settle it, for good: the daemon stuck, every later
request hung, close() giving up with the thread left running. So such a wait raises
SchedulerWaitError at once instead:

- `RequestFuture.result()` / `.exception()` without a timeout (a bounded one just
  times out), and `concurrent.futures.wait` / `as_completed` over it (they install a
  waiter: refused there, bounded or not);
- the daemon calls that wait for their own request (unregister, register, use() of
  tensors not resident), before they submit anything;
- a forward of an offloaded model whose turn another thread holds
  (prefetchd/hooks/pass_turn.py): that thread may be waiting for this scheduler.

Another daemon's future, or its calls, are not refused: its own scheduler settles them.
"""
import threading
from concurrent.futures import Future

from ..errors import SchedulerWaitError

_here = threading.local()          # .scheduler: the Scheduler this thread runs, if any


def mark_scheduler_thread(scheduler):
    """Called once by each scheduler thread (core/scheduler.py run)."""
    _here.scheduler = scheduler


def current_scheduler():
    """The Scheduler whose thread this is, or None."""
    return getattr(_here, "scheduler", None)


def refuse_wait_on_scheduler(call, scheduler=None):
    """SchedulerWaitError if this thread runs `scheduler` (any scheduler if None): `call`
    would wait for it."""
    here = current_scheduler()
    if here is not None and (scheduler is None or here is scheduler):
        raise SchedulerWaitError(
            f"{call} on a prefetchd scheduler thread (in a future's done-callback or a listener) "
            f"would wait forever: that thread settles what it waits for. Submit without waiting "
            f"there (add_done_callback), or do it from another thread")


class _Waiters(list):
    """A future's waiters (concurrent.futures.wait and as_completed append one)."""

    def __init__(self, future):
        super().__init__()
        self._future = future

    def append(self, waiter):
        if not self._future.done():
            refuse_wait_on_scheduler("concurrent.futures.wait()/as_completed()",
                                     self._future.settled_by)
        super().append(waiter)


class RequestFuture(Future):
    """The future of a request; `settled_by` is the Scheduler that settles it (set on submit)."""

    def __init__(self):
        super().__init__()
        self.settled_by = None
        self._waiters = _Waiters(self)

    def result(self, timeout=None):
        if timeout is None and not self.done():
            refuse_wait_on_scheduler("future.result()", self.settled_by)
        return super().result(timeout)

    def exception(self, timeout=None):
        if timeout is None and not self.done():
            refuse_wait_on_scheduler("future.exception()", self.settled_by)
        return super().exception(timeout)
