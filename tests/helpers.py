"""Small helpers shared by test modules (import as `from helpers import ...`)."""
import threading
import time


def wait_until(predicate, timeout=5.0, interval=0.02):
    """Poll `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class FakeMarker:
    """A compute-fence word (the daemon's compute marker) raised by the test: `reach(epoch)`."""

    def __init__(self):
        self.word = 0
        self.cond = threading.Condition()

    def reach(self, epoch):
        with self.cond:
            self.word = epoch
            self.cond.notify_all()

    def wait(self, epoch, timeout):
        with self.cond:
            self.cond.wait_for(lambda: self.word >= epoch, timeout)
            return self.word
