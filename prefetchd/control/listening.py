"""A server's pause and resume of its listening endpoints, for the connection guard.

An endpoint whose listener the guard saw bound is paused by its gate
(prefetchd.control.gates: a SYN filter for tcp, the socket file moved aside for ipc):
no new connection completes, and the connected peers are served on. Unbinding would
discard their pipes (their requests read and dropped, unanswered), so only an
endpoint no gate covers (an abstract ipc name) is unbound.

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
    `gates` (optional): `close(endpoint)` -> True if it stopped new connections there
    without an unbind, `open(endpoint)` undoes that. Owned by the server's I/O thread."""

    def __init__(self, bind, endpoints, gates=None):
        self._bind, self._endpoints, self._gates = bind, endpoints, gates
        self._unbound = []          # (socket, endpoint) a resume could not bind yet
        self._gated = []            # endpoints paused by their gate
        self.retry_at = None        # monotonic time of the next bind attempt, or None

    def stop(self):
        """The guard's pause: no new connections while descriptors are short."""
        waiting = {id(sock) for sock, _ in self._unbound}
        self._unbound, self.retry_at = [], None     # the resume binds every endpoint again
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
        for endpoint in gated:
            self._gates.open(endpoint)
        if gated:
            log.info("prefetchd server: accepting connections again on %s", ", ".join(gated))
        self._unbound = [(sock, endpoint) for sock, endpoint in self._endpoints() if endpoint not in gated]
        self._bind_unbound()

    def tick(self):
        if self.retry_at is not None and time.monotonic() >= self.retry_at:
            self._bind_unbound()

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
        self.retry_at = time.monotonic() + RELISTEN_INTERVAL if failed else None
        if not failed and endpoints:
            log.info("prefetchd server: accepting connections again on %s", ", ".join(endpoints))
