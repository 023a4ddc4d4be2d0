"""Files prefetchd writes for the user (a timeline trace, a plot): which paths it may write,
and writing one atomically.

A file is written to a new temporary file beside it (mkstemp: a name no one else could
have made, so no one's link there is followed) and renamed over PATH. A rename over a
device, a FIFO or a socket would replace that node with a regular file (as root,
`/dev/null` itself), so such a path is refused before anything runs, not at close(); so
is one whose directory is missing or not writable, which would lose the whole run's trace
at the end. A symlink at PATH is refused too: the rename would replace the link, and
following it would let another user's link (in a shared /tmp) name any file to overwrite.
"""
import contextlib
import os
import stat
import tempfile

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISLNK, "a symlink"))


def output_file_problem(path):
    """Why `path` cannot take a file prefetchd writes (None: it can)."""
    text = os.fspath(path)
    if not text:
        return "an empty path"
    full = os.path.abspath(os.path.expanduser(text))
    try:
        mode = os.lstat(full).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        return f"{text!r}: {e.strerror}"
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        return f"{text!r} is {kind}, not a regular file (writing it would replace it); give a file's own path"
    directory = os.path.dirname(full)
    if not os.path.isdir(directory):
        return f"{text!r}: directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{text!r}: directory {directory} is not writable"
    return None


def write_atomically(path, write):
    """Call write(binary file) on a new file beside `path`, then rename it over `path`;
    ValueError (nothing written) if `path` is no regular file or new one in a writable
    directory. Returns the path."""
    problem = output_file_problem(path)
    if problem is not None:
        raise ValueError(problem)
    full = os.path.abspath(os.path.expanduser(os.fspath(path)))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(full)}.", suffix=".tmp", dir=os.path.dirname(full))
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)     # (mkstemp's 0600: a trace is for other tools to open)
            write(f)
        os.replace(tmp, full)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return os.fspath(path)
