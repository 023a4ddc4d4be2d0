"""Heartbeats: the front pings each ready worker's control Server every
`interval` seconds; a worker that has answered nothing on it for `timeout`
seconds is hung (SIGSTOPped, deadlocked, swapped out) and is replaced: its
in-flight requests fail and it is killed, so the sentinel respawns it. The
control Server runs on its own thread, so a worker busy in a forward still
answers. Used on the front's I/O thread only."""
import time

import zmq

from ..control import protocol as P


class Heartbeats:
    def __init__(self, interval=1.0, timeout=15.0):
        self.interval, self.timeout = interval, timeout
        self._heard = {}            # slot index -> last time its control socket answered
        self._pinged = {}           # slot index -> last ping sent
        self._rids = {}             # ping rid -> slot index
        self._attended = None       # when the front's loop last looked (attend)

    def on_ready(self, slot, now=None):
        now = time.monotonic() if now is None else now
        self._heard[slot.index] = self._pinged[slot.index] = now

    def forget(self, slot):
        self._heard.pop(slot.index, None)
        self._pinged.pop(slot.index, None)
        for rid, index in list(self._rids.items()):
            if index == slot.index:
                self._rids.pop(rid)

    def heard(self, slot, rid, now=None):
        """A control reply from `slot`; True if it answered one of our pings."""
        if slot.index in self._heard:
            self._heard[slot.index] = time.monotonic() if now is None else now
        return self._rids.pop(rid, None) is not None

    def due(self, slots, now):
        """Ready slots to ping now."""
        return [s for s in slots if s.ready and s.index in self._pinged
                and now - self._pinged[s.index] >= self.interval]

    def ping_due(self, slots, now, new_rid):
        """Ping every ready slot whose interval has passed (a full queue skips one ping)."""
        for s in self.due(slots, now):
            rid = new_rid()
            try:
                s.ctl.send_multipart(P.encode_request(rid, "ping", {}), zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            self.sent(s, rid, now)

    def sent(self, slot, rid, now):
        self._pinged[slot.index] = now
        self._rids[rid] = slot.index

    def attend(self, now):
        """The front's loop looks again. Longer than an interval away (one huge message
        received whole, a swapped-out front) it read no replies either: that time is not
        the workers' silence, and killing them for it killed healthy workers."""
        if self._attended is not None:
            away = now - self._attended - self.interval
            if away > 0:       # (never past now: a reply read in this same round is fresh)
                for index, heard in self._heard.items():
                    self._heard[index] = min(heard + away, now)
        self._attended = now

    def hung(self, slots, now):
        return [s for s in slots if s.ready and s.index in self._heard
                and now - self._heard[s.index] > self.timeout]

    def next_due(self):
        times = [t + self.interval for t in self._pinged.values()]
        times += [t + self.timeout for t in self._heard.values()]
        return min(times, default=None)
