"""Residency events to subscribers: the daemon's listener hands each event over from the
scheduler thread (an append to a bounded deque and a wake-up, nothing more), and the
server's I/O thread publishes them on its PUB socket, numbered, topic = the event's kind.
A full queue or a subscriber that cannot take one drops it, counted (events_dropped)."""
import collections
import itertools

import zmq

from . import protocol as P
from .stats_codec import jsonable

MAX_EVENTS = 10000                 # queued residency events before new ones are dropped


class EventFeed:
    def __init__(self, counters, wake, daemon_name):
        self._counters = counters
        self._wake = wake              # fn(): wake the I/O loop
        self._name = daemon_name
        self._queue = collections.deque()
        self._seq = itertools.count(1)

    def on_event(self, event):
        """The daemon's listener (scheduler thread)."""
        if len(self._queue) >= MAX_EVENTS:
            self._counters.events_dropped += 1
            return
        self._queue.append(event)
        self._wake()

    def __bool__(self):
        return bool(self._queue)

    def publish(self, pub):
        """Send every queued event on `pub` (I/O thread)."""
        while self._queue:
            event = self._queue.popleft()
            try:
                kind = str(event.get("event", "event"))
                body = dict(event, seq=next(self._seq), daemon=self._name)
                pub.send_multipart([kind.encode(), P.dumps(jsonable(body))], zmq.NOBLOCK)
                self._counters.events_published += 1
            except (zmq.ZMQError, TypeError, ValueError, AttributeError):
                self._counters.events_dropped += 1
