"""The fence watcher: a thread that sleeps on the compute-fence word and wakes the scheduler."""
import threading


class FenceWatcher:
    """A thread that sleeps on the compute-fence word and wakes the scheduler.

    The scheduler never blocks on compute it does not have to: when it needs
    memory that a unit still computing holds, it asks for that unit's epoch
    here and goes on serving requests; this thread wakes it when the epoch is
    reached (futex wait, GIL released).
    """

    def __init__(self, marker, notify, name):
        self._marker, self._notify = marker, notify
        self._cond = threading.Condition()
        self._target = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"prefetchd-fence-{name}", daemon=True)
        self._thread.start()

    def want(self, epoch):
        """Wake the scheduler once the fence word reaches epoch; True if that is a new target."""
        with self._cond:
            if epoch > self._target:
                self._target = epoch
                self._cond.notify()
                return True
            return False

    def stop(self):
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(5.0)

    def _run(self):
        reached = 0
        while True:
            with self._cond:
                while not self._stopped and self._target <= reached:
                    self._cond.wait()
                if self._stopped:
                    return
                target = self._target
            # Bounded waits so stop() is prompt; each wake re-checks the target.
            now = self._marker.wait(target, 0.2)
            if now >= target:
                reached = now
                self._notify()
