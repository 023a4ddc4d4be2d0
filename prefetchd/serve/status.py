"""The front's `status` op: ask every ready worker's daemon for its status over
its control socket, wait at most STATUS_WAIT, and answer with what came back.

A status request never blocks the front's I/O thread: it becomes a Gather that
is answered when the last worker replies, when its deadline passes (the
missing workers show {"error": "no reply"}), or when a worker dies (that worker
shows {"error": "worker died"}). Used on the front's I/O thread only.
"""
import collections
import os
import time
from dataclasses import dataclass, field

import zmq

from ..control import protocol as P

STATUS_WAIT = 2.0               # seconds a status request waits for the workers' daemons


@dataclass
class Gather:
    """A status request waiting for the workers' daemons."""
    envelope: list
    rid: bytes
    deadline: float
    waiting: set
    results: dict = field(default_factory=dict)
    describe: object = None      # results -> the reply document


class StatusGathers:
    """The status requests in flight. `send(envelope, frames)` answers a client;
    `new_rid()` makes a control request id unique among the front's requests."""

    def __init__(self, send, new_rid):
        self._send = send
        self._new_rid = new_rid
        self._gathers = []
        self._asked = {}              # control rid -> (slot, gather)

    def start(self, envelope, rid, slots, describe):
        """Ask every ready slot's daemon; `describe(results)` builds the reply."""
        now = time.monotonic()
        g = Gather(envelope, rid, now + STATUS_WAIT, set(), describe=describe)
        for s in slots:
            if not s.ready:
                continue
            crid = self._new_rid()
            try:
                # The daemon's own timeout is shorter, so its answer beats our deadline.
                s.ctl.send_multipart(P.encode_request(crid, "status", {}, STATUS_WAIT * 0.75),
                                     zmq.NOBLOCK)
            except zmq.ZMQError:
                continue                 # shows as "no reply"; the sentinel tells why
            self._asked[crid] = (s, g)
            g.waiting.add(s.index)
        self._gathers.append(g)
        self.finish(now)

    def on_reply(self, slot, rid, doc):
        """A control reply; False if it answers no status request of ours."""
        entry = self._asked.pop(rid, None)
        if entry is None:
            return False
        g = entry[1]
        g.waiting.discard(slot.index)
        g.results[slot.index] = doc.get("result") if doc.get("ok") else {"error": doc.get("reason")}
        self.finish(time.monotonic())
        return True

    def on_death(self, slot):
        for crid, (s, _) in list(self._asked.items()):
            if s is slot:
                self._asked.pop(crid)
        for g in self._gathers:
            if slot.index in g.waiting:
                g.waiting.discard(slot.index)
                g.results[slot.index] = {"error": "worker died"}

    def nearest_deadline(self):
        return min((g.deadline for g in self._gathers), default=None)

    def finish(self, now):
        """Answer every gather that has all its replies or has run out of time."""
        for g in [g for g in self._gathers if not g.waiting or g.deadline <= now]:
            self._gathers.remove(g)
            for crid, (_, pending) in list(self._asked.items()):
                if pending is g:
                    self._asked.pop(crid)    # a late reply is then ignored
            self._send(g.envelope, P.encode_ok(g.rid, g.describe(g.results)))


def status_document(front_info, slots, results):
    """The reply of `status`: the front's own state, each worker's public state with
    its daemon's status (or why there is none), and totals over the daemons."""
    workers = []
    total = collections.Counter()
    for s in slots:
        daemon = results.get(s.index)
        workers.append(dict(s.public(),
                            daemon=daemon if daemon is not None else {"error": "no reply"}))
        if daemon and "device" in daemon:
            total["device_used"] += daemon["device"]["used"]
            total["device_capacity"] += daemon["device"]["capacity"]
            total["resident"] += daemon["states"].get("resident", 0)
            total["tensors"] += daemon["tensors"]
    return {"front": dict(front_info, pid=os.getpid()), "workers": workers, "total": dict(total)}
