"""Idle connections give way to new ones at a connection budget (the guard of the
daemon's control server and of the serve front, prefetchd.control.connections).

An HTTP server's keep-alive timeout, applied only under pressure: at a budget (the
total, or the new connection's peer's), the connection of that budget that has gone
longest without a request, none of its requests unanswered and idle at least
`idle_after` seconds, is shut down for the new one.

The new one takes that place only at its first request. libzmq connects a shut-down
connection again by itself, at once (its reconnect interval, 100 ms), not when its
client next sends. Evicting at the accept, one process holding more idle connections
than the budget refilled every place it lost with its own reconnects, so every place
stayed younger than `idle_after` and every new client was dropped with its first
request (an outside probe: 700 idle sockets against the serve front's 512). So a
connection accepted over a budget waits, at most `waiting_budget` of them, and is let
in at its first request in the place of an idle one. The reconnects of idle clients
send none: they churn among the waiting only. A new one beyond the budget pushes out
the oldest waiting connection of the peer (a process on ipc) that has the most of
them waiting: pushing out the oldest of all, thousands of reconnecting sockets
(6,700 a second) pushed a client's connection out between its connect and its first
request (an outside probe). On tcp all of loopback is one peer.

A socket whose peers send no requests (a PUB socket's subscribers: `never_idle`) is
never idle, and its new connections never wait: they take an idle place at the
accept or are dropped there.
"""
import collections
import time


class IdleRoom:
    """When each live connection last sent a request, and the connections waiting for
    their first one; runs on the guard's thread (no lock). With `idle_after` None (a
    server that does not report its requests) nothing waits and nothing gives way."""

    def __init__(self, idle_after, busy, waiting_budget):
        self.idle_after = idle_after
        self._busy = busy                          # () -> descriptors with a request unanswered
        self.waiting_budget = waiting_budget
        self.waiting = collections.OrderedDict()   # fd -> its peer's key, oldest first
        self._last = {}                            # live fd -> monotonic time of its last request
        self._never_idle = set()

    def never_idle(self, fd):
        self._never_idle.add(fd)

    def may_wait(self, fd):
        return self.idle_after is not None and fd not in self._never_idle

    def saw(self, fd):
        """Live connection `fd` was let in, or sent a request."""
        self._last[fd] = time.monotonic()

    def wait(self, fd, key):
        """Hold `fd` (of peer `key`) until its first request; returns the waiting
        connections it pushed out, to shut down."""
        self.waiting[fd] = key
        return [self.push_out() for _ in range(len(self.waiting) - self.waiting_budget)]

    def push_out(self):
        """Take out and return the waiting connection to shut down first: the oldest of the
        peer with the most waiting (module docstring)."""
        counts = collections.Counter(self.waiting.values())
        most = max(counts.values())
        fd = next(fd for fd, key in self.waiting.items() if counts[key] == most)
        del self.waiting[fd]
        return fd

    def forget(self, fd):
        """`fd` is no longer a connection of ours (gone, shut down, or taken out of waiting)."""
        self._last.pop(fd, None)
        self.waiting.pop(fd, None)
        self._never_idle.discard(fd)

    def victim(self, candidates):
        """The connection among live `candidates` to give way: the one longest without a
        request, idle at least idle_after and none of its requests unanswered; else None."""
        if self.idle_after is None:
            return None
        busy = self._busy() if self._busy is not None else ()
        cutoff = time.monotonic() - self.idle_after
        idle = [(self._last.get(fd, 0.0), fd) for fd in candidates
                if fd not in busy and fd not in self._never_idle]
        idle = [item for item in idle if item[0] <= cutoff]
        return min(idle)[1] if idle else None
