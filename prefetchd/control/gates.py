"""The guard's pause of one endpoint without an unbind, by the endpoint's kind.

A tcp listener is gated by a filter that drops new connections' SYNs
(prefetchd.control.syn_gate), an ipc one by moving its socket file aside
(prefetchd.control.path_gate). Either way the clients connected already are served
on; an unbind would discard their pipes. An endpoint neither covers (an abstract
ipc name, a listener the guard never saw bound) is unbound by the caller
(prefetchd.control.listening).
"""
import logging

from . import path_gate, syn_gate

log = logging.getLogger("prefetchd.control.server")


class _SynGate:
    def __init__(self, fd):
        self.fd, self.ident = fd, syn_gate.listener_id(fd)

    def close(self):
        return syn_gate.close(self.fd, self.ident)

    def open(self):
        return syn_gate.open_(self.fd, self.ident)


class _PathGate:
    def __init__(self, path):
        self.path, self.ident = path, path_gate.file_id(path)

    def close(self):
        return path_gate.close(self.path, self.ident)

    def open(self):
        return path_gate.open_(self.path, self.ident)


def _gate_for(endpoint, fd):
    if endpoint.startswith("tcp://"):
        return _SynGate(fd)
    path = path_gate.path_of(endpoint)
    return _PathGate(path) if path is not None else None


class Gates:
    """The listeners the guard saw bound (monitor LISTENING events carry the endpoint and
    the listener's descriptor), by endpoint. I/O thread only."""

    def __init__(self):
        self._gates = {}                 # endpoint -> its gate (None: unbind it)
        self._closed = set()             # endpoints whose gate is closed now

    def saw(self, endpoint, fd):
        self._gates[endpoint] = _gate_for(endpoint, fd)

    def close(self, endpoint):
        """True if new connections to `endpoint` stop without an unbind."""
        gate = self._gates.get(endpoint)
        if gate is None or not gate.close():
            return False
        self._closed.add(endpoint)
        return True

    def open(self, endpoint):
        self._closed.discard(endpoint)
        gate = self._gates.get(endpoint)
        if gate is None or not gate.open():
            log.warning("prefetchd server: the gate of %s was gone when it was to open", endpoint)

    def open_all(self):
        """Open every closed gate (at teardown: an ipc listener's file goes back to its
        path, where libzmq removes it as the socket closes)."""
        for endpoint in list(self._closed):
            self.open(endpoint)
