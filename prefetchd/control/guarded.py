"""A server's listening sockets under the connection guard: the one piece its I/O loop drives.

The daemon's control server (prefetchd.control.server) and the serve front
(prefetchd.serve.front) each bind sockets anyone who can reach them may connect to, and
wire the same parts the same way: the guard (prefetchd.control.connections) watches each
socket before it binds, its monitors are polled with the server's sockets, it settles
what was accepted after every poll, and it pauses and resumes the endpoints
(prefetchd.control.listening) when descriptors run short; an endpoint a resume could not
open or bind again is retried on the loop's clock (`wake_at`).
"""
from .connections import DEFAULT_FD_RESERVE, ConnectionGuard
from .listening import Listening


class GuardedListening:
    """`bind(socket, endpoint)` binds one endpoint; `endpoints()` -> [(socket, endpoint)]
    the server listens on. Owned by the server's I/O thread, like its parts."""

    def __init__(self, bind, endpoints, max_connections, max_per_peer, fd_reserve=DEFAULT_FD_RESERVE,
                 idle_after=None, busy=None):
        self.guard = ConnectionGuard(max_connections, max_per_peer, fd_reserve,
                                     on_pause=self._pause, on_resume=self._resume,
                                     idle_after=idle_after, busy=busy)
        self.listening = Listening(bind, endpoints, gates=self.guard.gates)

    def _pause(self):
        self.listening.stop()

    def _resume(self):
        self.listening.resume()

    def watch(self, sock, curve=False, idle=True):
        """Call before `sock` binds, so that no connection to it goes unseen (`curve`: it is
        a CURVE server, whose handshake is longer; `idle=False`: its peers send no requests,
        and are never shut down as idle)."""
        self.guard.watch(sock, curve, idle)

    def saw(self, fd):
        """A request arrived on connection `fd` (zmq.Frame.get(zmq.SRCFD) of its first frame);
        False if that connection is dropped (the request is not to be answered)."""
        return self.guard.saw(fd)

    def shut(self, fd):
        """Shut down connection `fd` (zmq.SRCFD of a request), if it is still the one accepted."""
        return self.guard.shut(fd)

    def poll_items(self):
        """The guard's monitor sockets, for the I/O loop's poll."""
        return self.guard.poll_items()

    def tick(self):
        """After every poll: admit or drop what was accepted, bind again what is due."""
        self.guard.settle()
        self.listening.tick()

    @property
    def wake_at(self):
        """Monotonic time the loop must tick by (an endpoint to open or bind again), or None."""
        return self.listening.retry_at

    def counts(self):
        """What a server's status reports of its connections and listening: the guard's
        counts, and the endpoints a resume could not open or bind yet."""
        return {**self.guard.counts(), "listening_stuck": self.listening.waiting()}

    def close(self):
        """At teardown, before the sockets close."""
        self.guard.close()
