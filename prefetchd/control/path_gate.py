"""Stop an ipc listener from taking new connections without unbinding it.

The connection guard (prefetchd.control.connections) stops listening while the
descriptors run short. Unbinding a libzmq endpoint discards the pipes of the clients
connected to it (zmq_unbind(3); prefetchd.control.syn_gate has the measurement), and a
unix socket has no SYN for a filter to drop. But a unix client finds the listener by
its path: with the socket file moved aside (a hidden name in the same directory,
`.NAME.paused-RANDOM`, mode 0 meanwhile so that a process of the owner's finding it
there is refused too, root excepted), a new client's connect fails (ENOENT; libzmq
tries again every reconnect interval), while the listening socket and every
connection it accepted go on untouched. Moving the file back lets new clients in
again. Measured: a DEALER connected before the move got its request through during
it, one connecting during it got in only after the move back. What the listener had
queued already (its backlog) is still accepted: the guard keeps the backlog below its
descriptor reserve (prefetchd.control.connections.configure).

The file is moved aside only while it is the one seen when the listener was bound
(same device and inode). Moving it back replaces a stale file at the path, as a bind
does (prefetchd.control.endpoints.bind), but never a live server's socket: then the
gate stays closed and the caller tries again later.
"""
import os
import secrets
import stat

from ..socket_dirs import listener_at

PREFIX = "ipc://"
HIDDEN = ".{name}.paused-"


def path_of(endpoint):
    """The socket file of an ipc endpoint, or None (tcp, or the abstract namespace)."""
    if not endpoint.startswith(PREFIX) or endpoint[len(PREFIX):].startswith("@"):
        return None
    return endpoint[len(PREFIX):] or None


def file_id(path):
    """(device, inode) of the socket file at `path`, or None if there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def stale(path):
    """True if nothing listens at `path` (no file, not a socket, or a socket nobody
    accepts on); False if something may (it accepted, or refused us the check)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return True
    except FileNotFoundError:
        return True
    return listener_at(path) is False


def asides(path):
    """The hidden names beside `path` its listeners' pauses moved it to ([] if none, or if
    the directory cannot be listed)."""
    head, tail = os.path.split(path)
    prefix = HIDDEN.format(name=tail)
    try:
        return [os.path.join(head, n) for n in os.listdir(head or ".") if n.startswith(prefix)]
    except OSError:
        return []


def remove_stale_aside(path):
    """Remove the hidden names a process killed while paused left beside `path`."""
    for aside in asides(path):
        if _stale_aside(aside):
            _unlink(aside)


def _stale_aside(aside):
    """stale() for a hidden file: mode 0 refuses the check's connect to its owner too
    (root excepted), so an own file is opened to the owner for the moment of the check."""
    try:
        st = os.lstat(aside)
    except OSError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode):
        return stale(aside)
    try:
        os.chmod(aside, 0o600)
    except OSError:
        return False
    try:
        return stale(aside)
    finally:
        _chmod(aside, 0)


class PathGate:
    """The gate of one listener's socket file `path`, bound as the file `ident`."""

    def __init__(self, path, ident):
        self.path, self.ident = path, ident
        self.aside = None            # the hidden name while closed
        self._mode = None

    @property
    def stuck(self):
        """Closed, and the file is still at its hidden name: an open may succeed later."""
        return self.aside is not None and file_id(self.aside) == self.ident

    def close(self):
        """Move the file aside: new clients cannot find it. True if moved."""
        if self.ident is None or file_id(self.path) != self.ident:
            return False
        head, tail = os.path.split(self.path)
        aside = os.path.join(head, HIDDEN.format(name=tail) + secrets.token_hex(4))
        try:
            mode = stat.S_IMODE(os.lstat(self.path).st_mode)
        except OSError:
            return False
        try:
            os.chmod(self.path, 0)
            os.link(self.path, aside)           # EEXIST rather than replace anything
            os.unlink(self.path)
        except OSError:
            if file_id(aside) == self.ident:    # linked, not unlinked: undo the link
                _unlink(aside)
            _chmod(self.path, mode)
            return False
        self.aside, self._mode = aside, mode
        return True

    def open(self):
        """Move the file back. True if it is back; False if the path holds a live server's
        socket now (the gate stays closed: try again later) or the file is gone."""
        if self.aside is None or file_id(self.aside) != self.ident:
            self.aside = None
            return False
        try:
            os.link(self.aside, self.path)
        except FileExistsError:
            if not stale(self.path):
                return False
            try:
                os.rename(self.aside, self.path)    # over the stale file, as a bind would
            except OSError:
                return False                        # (a directory there): stays stuck
        except OSError:
            return False
        else:
            _unlink(self.aside)
        _chmod(self.path, self._mode)
        self.aside = None
        return True

    def discard(self):
        """At close, when the file could not go back: remove it from its hidden name."""
        if self.aside is not None and file_id(self.aside) == self.ident:
            _unlink(self.aside)
        self.aside = None


def _chmod(path, mode):
    try:
        os.chmod(path, mode)
    except OSError:
        pass                 # gone meanwhile: nothing left to give the mode back to


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass
