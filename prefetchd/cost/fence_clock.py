"""The thread that notes when compute reaches each unit's fence (for the cost model's
compute_seconds_from_fences); no MindSpore: the marker it waits on is handed in."""
import queue
import threading
import time


class FenceClock:
    """When compute fences were reached, for `compute_seconds_from_fences`.

    marker: anything with `wait(epoch, timeout) -> epoch reached` (the daemon's
    `compute_marker()`). Per unit, after its kernels were dispatched:
    `clock.unit(marker.mark(output), dispatched_ns)`; `stop()` returns
    (dispatch_ns, fence_ns). A thread sleeps on the fence word meanwhile (futex,
    GIL released), so timing costs the compute thread nothing. Units whose
    fences were passed together get the same time (their compute is then
    attributed to the first of them): the sum stays right.

    alive: `() -> bool`, False once the marker's daemon closed. A pass cut short by the
    daemon closing under it is never sealed, so the thread also looks at it every
    WAKE seconds and ends within one look after (it waited for good, one per close).
    """

    WAKE = 0.2

    def __init__(self, marker, clock=time.monotonic_ns, alive=lambda: True):
        self._marker, self._clock, self._alive = marker, clock, alive
        self._queue = queue.SimpleQueue()
        self._dispatch, self._fences = [], []
        self._closed = threading.Event()
        self.sealed = False          # no more units (seal, stop, close)
        self._thread = threading.Thread(target=self._run, name="prefetchd-fence-clock", daemon=True)
        self._thread.start()

    def unit(self, epoch, dispatched_ns):
        self._dispatch.append(dispatched_ns)
        self._queue.put(epoch)

    def reached(self):
        """Compute reached every fence given so far: stop() returns at once."""
        return len(self._fences) == len(self._dispatch)

    def seal(self):
        """No more units: the thread ends once compute reached the fences given."""
        if not self.sealed:
            self.sealed = True
            self._queue.put(None)

    def close(self):
        """Stop timing without waiting: the thread ends within one wait (0.2 s)."""
        self._closed.set()
        self.seal()

    def stop(self, timeout=30.0):
        self.seal()
        self._thread.join(timeout)
        if self._thread.is_alive() or len(self._fences) != len(self._dispatch):
            raise TimeoutError(f"compute reached {len(self._fences)} of {len(self._dispatch)} fences "
                               f"within {timeout}s")
        return list(self._dispatch), list(self._fences)

    def _run(self):
        while True:
            try:
                epoch = self._queue.get(timeout=self.WAKE)
            except queue.Empty:
                if self._alive():
                    continue
                return
            if epoch is None:
                return
            deadline = time.monotonic() + 60.0
            while self._marker.wait(epoch, self.WAKE) < epoch:
                if time.monotonic() > deadline or self._closed.is_set() or not self._alive():
                    return           # stop() reports the shortfall
            self._fences.append(self._clock())
