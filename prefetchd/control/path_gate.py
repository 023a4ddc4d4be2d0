"""Stop an ipc listener from taking new connections without unbinding it.

The connection guard (prefetchd.control.connections) stops listening while the
descriptors run short. Unbinding a libzmq endpoint discards the pipes of the clients
connected to it (zmq_unbind(3); prefetchd.control.syn_gate has the measurement), and a
unix socket has no SYN for a filter to drop. But a unix client finds the listener by
its path: with the socket file moved aside (a hidden name in the same directory), a
new client's connect fails (ENOENT; libzmq tries again every reconnect interval),
while the listening socket and every connection it accepted go on untouched.
Moving the file back lets new clients in again. Measured: a DEALER connected before
the move got its request through during it, one connecting during it got in only
after the move back.

The file is moved only while it is the one seen when the listener was bound (same
device and inode), and by link-then-unlink, so neither move replaces a file that
took its place meanwhile. An abstract-namespace endpoint (`ipc://@name`) has no
file: `close` says False and the caller unbinds instead.
"""
import os
import stat

PREFIX = "ipc://"


def path_of(endpoint):
    """The socket file of an ipc endpoint, or None (tcp, or the abstract namespace)."""
    if not endpoint.startswith(PREFIX) or endpoint[len(PREFIX):].startswith("@"):
        return None
    return endpoint[len(PREFIX):] or None


def _aside(path):
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.paused-{os.getpid()}")


def file_id(path):
    """(device, inode) of the socket file at `path`, or None if there is none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino) if stat.S_ISSOCK(st.st_mode) else None


def _move(src, dst, ident):
    """Move the socket file `ident` from src to dst, replacing nothing. True if moved."""
    if ident is None or file_id(src) != ident:
        return False
    try:
        os.link(src, dst)            # EEXIST rather than replace what is at dst
    except OSError:
        return False
    os.unlink(src)
    return True


def close(path, ident):
    """Move the listener's file aside: new clients cannot find it. True if moved."""
    return _move(path, _aside(path), ident)


def open_(path, ident):
    """Move the listener's file back. True if it was aside and is back."""
    return _move(_aside(path), path, ident)
