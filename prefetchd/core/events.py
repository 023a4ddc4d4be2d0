"""Residency events for listeners (the control plane's PUB socket, tests, tools).

Listeners run on the scheduler thread and must not block; one that raises
is logged and skipped, never allowed to take the scheduler down.
"""
import logging

log = logging.getLogger("prefetchd")


class Events:
    def __init__(self):
        self._listeners = []

    def add(self, fn):
        self._listeners.append(fn)

    def remove(self, fn):
        if fn in self._listeners:
            self._listeners.remove(fn)

    def emit(self, event, rec, seconds=0.0, error=None):
        if not self._listeners:
            return
        payload = {"event": event, "name": rec.name, "nbytes": rec.nbytes,
                   "seconds": seconds, "error": error}
        for fn in list(self._listeners):
            try:
                fn(payload)
            except Exception:
                log.exception("prefetchd listener failed")
