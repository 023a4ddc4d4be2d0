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


class _Gate:
    """One listener's gate: `kind` is the module that works it (syn_gate or path_gate),
    `where` the listener's descriptor or socket file, `ident` what it was when bound."""

    def __init__(self, kind, where, ident):
        self.kind, self.where, self.ident = kind, where, ident

    def close(self):
        return self.kind.close(self.where, self.ident)

    def open(self):
        return self.kind.open_(self.where, self.ident)


def _gate_for(endpoint, fd):
    if endpoint.startswith("tcp://"):
        return _Gate(syn_gate, fd, syn_gate.listener_id(fd))
    path = path_gate.path_of(endpoint)
    return None if path is None else _Gate(path_gate, path, path_gate.file_id(path))


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
        path, where the server's close removes it; libzmq leaves socket files behind)."""
        for endpoint in list(self._closed):
            self.open(endpoint)
