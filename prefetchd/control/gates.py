"""The guard's pause of one endpoint without an unbind, by the endpoint's kind.

A tcp listener is gated by a filter that drops new connections' SYNs
(prefetchd.control.syn_gate), an ipc one by moving its socket file aside
(prefetchd.control.path_gate). Either way the clients connected already are served
on; an unbind would discard their pipes. An endpoint neither covers (a listener the
guard never saw bound) is unbound by the caller (prefetchd.control.listening).

Each gate: `close()` -> True if new connections stop; `open()` -> True if they are let
in again; `stuck`, True while an open that failed may succeed later (an ipc path that
another server holds for now; never for tcp); `discard()`, at teardown, for a gate that
could not open.
"""
from . import path_gate, syn_gate


class SynGate:
    """A tcp listener's descriptor `fd`, as seen bound."""

    stuck = False

    def __init__(self, fd):
        self.fd, self.ident = fd, syn_gate.listener_id(fd)

    def close(self):
        return syn_gate.close(self.fd, self.ident)

    def open(self):
        return syn_gate.open_(self.fd, self.ident)

    def discard(self):
        pass


def _gate_for(endpoint, fd):
    if endpoint.startswith("tcp://"):
        return SynGate(fd)
    path = path_gate.path_of(endpoint)
    if path is None:
        return None
    path_gate.remove_stale_aside(path)
    return path_gate.PathGate(path, path_gate.file_id(path))


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
        """True if new connections to `endpoint` are let in again. False: `stuck(endpoint)`
        says whether to try again later, else the gate is gone (unbind and bind again)."""
        gate = self._gates.get(endpoint)
        if gate is not None and gate.open():
            self._closed.discard(endpoint)
            return True
        if not self.stuck(endpoint):
            self._closed.discard(endpoint)
        return False

    def stuck(self, endpoint):
        gate = self._gates.get(endpoint)
        return gate is not None and endpoint in self._closed and gate.stuck

    def open_all(self):
        """At teardown: open every closed gate (an ipc listener's file goes back to its path,
        where the server's close removes it; libzmq leaves socket files behind), or, where
        one cannot open, remove its file from the hidden name."""
        for endpoint in list(self._closed):
            if not self.open(endpoint):
                self._gates[endpoint].discard()
                self._closed.discard(endpoint)
