"""Prefetch hints: before a batch of a model a worker did not run last, the front asks
that worker's daemon (over its control socket) to start loading the model's first
tensors, so the load overlaps the batch's trip to the worker. Fire and forget: the
batch never waits for a hint, whose reply is only counted (hints_ok / hints_failed).
I/O thread only.
"""
import zmq

from ..control import protocol as P


class Hints:
    def __init__(self, counters, new_rid):
        self._counters = counters
        self._new_rid = new_rid        # fn() -> a control request id
        self._waiting = {}             # control rid -> slot

    def send(self, s, model):
        """Hint slot `s` to load `model`'s first tensors; True if a hint was sent."""
        names = s.hints.get(model)
        if not names:
            return False
        rid = self._new_rid()
        try:
            s.ctl.send_multipart(P.encode_request(rid, "prefetch", {
                "names": names, "wait": False, "priority": 1}), zmq.NOBLOCK)
        except zmq.ZMQError:
            self._counters["hints_dropped"] += 1
            return False
        self._waiting[rid] = s
        self._counters["hints_sent"] += 1
        return True

    def on_reply(self, rid, doc):
        """Count a control reply if it answers a hint; True if it did."""
        if self._waiting.pop(rid, None) is None:
            return False
        self._counters["hints_ok" if doc.get("ok") else "hints_failed"] += 1
        return True

    def forget(self, s):
        """Slot `s` died: its hints will never be answered."""
        for rid, slot in list(self._waiting.items()):
            if slot is s:
                del self._waiting[rid]
