"""Unix socket files that other users cannot replace: a private directory for them, and
whether a live listener holds a path (prefetchd.control.endpoints' ipc endpoints, the
shared host tier's owner socket)."""
import os
import socket
import stat
import struct

from .errors import ConfigError


def ensure_private_dir(path):
    """Create `path` as a 0700 directory, or check that the existing one is ours and
    make it private (the runtime directory is ours to fix)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"socket directory {path} exists and is not a directory")
    if st.st_uid != os.getuid():
        raise ConfigError(f"socket directory {path} belongs to uid {st.st_uid}, not to us "
                          f"({os.getuid()}); refusing to put a socket there")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def check_private_dir(path, hint="e.g. ipc://name.sock for the runtime directory"):
    """Refuse a directory the user named for an ipc socket unless it is ours and not
    group/world-writable: anyone who can write there could replace our socket file
    with theirs. Unlike `ensure_private_dir` it never changes the directory."""
    real = os.path.realpath(path)
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"socket directory {path} is not a directory")
    if st.st_uid != os.getuid():
        raise ConfigError(f"socket directory {path} belongs to uid {st.st_uid}, not to us "
                          f"({os.getuid()}); put the socket in a directory of our own ({hint})")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise ConfigError(f"socket directory {path} is group- or world-writable "
                          f"(mode {stat.S_IMODE(st.st_mode):o}); put the socket in a private "
                          f"directory ({hint})")
    return path


def check_parent_dir(path, name, hint):
    """Refuse a directory that will hold our private socket directory unless it is ours (or
    root's) and writable by no one else, or sticky as /tmp is. Laxer than check_private_dir,
    for a parent: whoever can write to it (and rename in it) can move our private directory
    aside and put sockets of theirs at its paths (a worker attaching to a shared host tier
    there would take its blocks). `name` says what the path is, `hint` what to do."""
    st = os.stat(path)
    mine = st.st_uid in (os.getuid(), 0)
    open_to_others = stat.S_IMODE(st.st_mode) & 0o022 and not st.st_mode & stat.S_ISVTX
    if not mine or open_to_others:
        who = f"owned by uid {st.st_uid}" if not mine else \
            f"writable by others (mode {stat.S_IMODE(st.st_mode):o})"
        raise ConfigError(f"{name} is {path}, {who}: its sockets could be replaced by another user "
                          f"{hint}")
    return path


def private_socket_dir(path, hint="e.g. ipc://name.sock for the runtime directory"):
    """Make the directory of socket file `path` (0700) if it is missing, else refuse one that
    is not private (check_private_dir): anyone who can write there could replace the socket."""
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        os.makedirs(os.path.dirname(parent), exist_ok=True)
        ensure_private_dir(parent)
    else:
        check_private_dir(parent, hint)


_PEERCRED = struct.Struct("3i")


def peer_credentials(sock):
    """(pid, uid, gid) of the process at the other end of unix socket `sock` (SO_PEERCRED)."""
    return _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))


def refuse_non_socket(path, what):
    """Refuse `path` when a file other than a unix socket is there: it is someone's file, not
    a dead listener's socket, and binding would delete it (libzmq unlinks what it finds)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "a file that is not a socket"
        raise ConfigError(f"{what} {path}: {kind} is there, and binding would delete it; choose "
                          f"another path, or remove it")


def listener_at(path, kind=socket.SOCK_STREAM):
    """True if a unix socket at `path` accepted a connect (of a `kind` socket: the listener's
    own type), False if it refused it (nobody listens), None if the connect said neither (no
    such file, no permission, a timeout)."""
    probe = socket.socket(socket.AF_UNIX, kind)
    try:
        probe.settimeout(0.5)
        probe.connect(path)
    except ConnectionRefusedError:
        return False
    except OSError:
        return None
    finally:
        probe.close()
    return True
