"""A server's pause and resume of its listening endpoints, for the connection guard.

An endpoint whose listener the guard saw bound is paused by its gate
(prefetchd.control.gates: a SYN filter for tcp, the socket file moved aside for ipc):
no new connection completes, and the connected peers are served on. Unbinding would
discard their pipes (their requests read and dropped, unanswered), so only an
endpoint no gate covers (a listener the guard did not see bound, or whose gate is
gone) is unbound. A gate that cannot open yet (an ipc path another server's socket
holds) is tried again every RELISTEN_INTERVAL, like a bind.

While an endpoint is unbound, any outgoing connection on this machine may be given
its port as a source port if it is in the ephemeral range (prefetchd.control.endpoints
picks `:0` ports outside it where it can); binding it again then fails with
EADDRINUSE until that connection closes. So a resume
retries every RELISTEN_INTERVAL until every endpoint is bound, never gives up.
"""
import logging
import time

import zmq

from ..errors import ConfigError

log = logging.getLogger("prefetchd.control.server")
RELISTEN_INTERVAL = 0.1       # seconds between binds of an endpoint whose port a connection holds


class Listening:
    """`endpoints()` -> [(socket, endpoint)]; `bind(socket, endpoint)` binds one;
    `gates` (optional, prefetchd.control.gates.Gates): `close(endpoint)` -> True if it
    stopped new connections there without an unbind, `open(endpoint)` -> True if it undid
    that, `stuck(endpoint)` -> True if an open that failed may succeed later. Owned by the
    server's I/O thread."""

    def __init__(self, bind, endpoints, gates=None):
        self._bind, self._endpoints, self._gates = bind, endpoints, gates
        self._unbound = []          # (socket, endpoint) a resume could not bind yet
        self._gated = []            # endpoints paused by their gate
        self._stuck = []            # endpoints whose gate a resume could not open yet
        self.retry_at = None        # monotonic time of the next attempt, or None

    def waiting(self):
        """The endpoints a resume could not open or bind yet (retried every RELISTEN_INTERVAL)."""
        return list(self._stuck) + [endpoint for _, endpoint in self._unbound]

    def stop(self):
        """The guard's pause: no new connections while descriptors are short."""
        waiting = {id(sock) for sock, _ in self._unbound}
        self._unbound, self.retry_at = [], None     # the resume binds every endpoint again
        self._gated += self._stuck                  # ... and opens these with the others
        self._stuck = []
        for sock, endpoint in self._endpoints():
            if id(sock) in waiting or endpoint in self._gated:
                continue
            if self._gates is not None and self._gates.close(endpoint):
                self._gated.append(endpoint)
                continue
            try:
                sock.unbind(endpoint)
            except zmq.ZMQError as e:
                log.warning("prefetchd server: could not stop listening on %s: %s", endpoint, e)

    def resume(self):
        gated, self._gated = self._gated, []
        self._unbound = [(sock, endpoint) for sock, endpoint in self._endpoints() if endpoint not in gated]
        self._open(gated, first=True)
        self._bind_unbound()

    def tick(self):
        if self.retry_at is not None and time.monotonic() >= self.retry_at:
            stuck, self._stuck = self._stuck, []
            self._open(stuck, first=False)
            self._bind_unbound()

    def _open(self, endpoints, first):
        opened = []
        for endpoint in endpoints:
            if self._gates.open(endpoint):
                opened.append(endpoint)
            elif self._gates.stuck(endpoint):
                if first:
                    log.error("prefetchd server: could not take new connections on %s again "
                              "(retrying): its socket file cannot go back to its path (another "
                              "server's socket there, a directory, or the directory's permissions)",
                              endpoint)
                self._stuck.append(endpoint)
            else:
                # The gate is gone (its file removed meanwhile): listen afresh.
                log.warning("prefetchd server: the gate of %s was gone when it was to open; "
                            "binding it again", endpoint)
                for sock, ep in self._endpoints():
                    if ep == endpoint:
                        self._unbind(sock, endpoint)
                        self._unbound.append((sock, endpoint))
        if opened:
            log.info("prefetchd server: accepting connections again on %s", ", ".join(opened))

    @staticmethod
    def _unbind(sock, endpoint):
        try:
            sock.unbind(endpoint)
        except zmq.ZMQError:
            pass

    def _bind_unbound(self):
        endpoints = [endpoint for _, endpoint in self._unbound]
        failed = []
        for sock, endpoint in self._unbound:
            try:
                self._bind(sock, endpoint)
            except (zmq.ZMQError, ConfigError) as e:
                if self.retry_at is None:
                    log.error("prefetchd server: could not listen on %s again (retrying): %s", endpoint, e)
                failed.append((sock, endpoint))
        self._unbound = failed
        self.retry_at = time.monotonic() + RELISTEN_INTERVAL if failed or self._stuck else None
        if not failed and endpoints:
            log.info("prefetchd server: accepting connections again on %s", ", ".join(endpoints))
