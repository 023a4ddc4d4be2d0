"""Small helpers shared by test modules (import as `from helpers import ...`)."""
import time


def wait_until(predicate, timeout=5.0, interval=0.02):
    """Poll `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
