"""Residency events for listeners (the control plane's PUB socket, tests, tools).

The scheduler emits events while it holds the daemon's lock; they are only
queued there. `deliver()` runs the listeners on the scheduler thread after the
lock is released and before that iteration's futures are settled, so a
listener sees an event before anyone waiting on the request does, and may call
any public method of the daemon (status, tensors, flush, even close) without a
deadlock. A listener must still not wait on a daemon future: the scheduler
thread that would settle it is the one running the listener. One that raises
is logged and skipped, never allowed to take the scheduler down.
"""
import collections
import logging

log = logging.getLogger("prefetchd")


class Events:
    def __init__(self):
        self._listeners = []
        self._queued = collections.deque()    # payloads emitted under the lock, not yet delivered

    def add(self, fn):
        if not callable(fn):     # else a traceback logged at every event
            raise TypeError(f"a listener is called with each event dict; {type(fn).__name__} is not callable")
        self._listeners.append(fn)

    def remove(self, fn):
        if fn in self._listeners:
            self._listeners.remove(fn)

    def emit(self, event, rec, seconds=0.0, error=None):
        """Queue an event (called under the daemon's lock: runs no listener)."""
        if not self._listeners:
            return
        self._queued.append({"event": event, "name": rec.name, "nbytes": rec.nbytes,
                             "seconds": seconds, "error": error})

    def deliver(self):
        """Run the listeners on every queued event (called without the daemon's lock)."""
        while self._queued:
            payload = self._queued.popleft()
            for fn in list(self._listeners):
                try:
                    fn(payload)
                except Exception:
                    log.exception("prefetchd listener failed")
