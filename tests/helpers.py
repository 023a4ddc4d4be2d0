"""Small helpers shared by test modules (import as `from helpers import ...`)."""
import os
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment of a child process that must import this checkout's prefetchd.
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))


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
