"""Files prefetchd writes for the user (a timeline trace, a plot): which paths it may write.

A trace is written atomically, to `PATH.tmpPID` and renamed over PATH, so a rename over a
device, a FIFO or a socket would replace that node with a regular file (as root, `/dev/null`
itself). Such a path is refused before anything runs, not at close(); so is one whose
directory is missing or not writable, which would lose the whole run's trace at the end. A
symlink is followed: the file it names is the one written.
"""
import os
import stat

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))


def output_file_problem(path):
    """Why `path` cannot take a file prefetchd writes (None: it can)."""
    text = os.fspath(path)
    if not text:
        return "an empty path"
    real = os.path.realpath(os.path.expanduser(text))
    try:
        mode = os.stat(real).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as e:
        return f"{text!r}: {e.strerror}"
    if mode is not None and not stat.S_ISREG(mode):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        return f"{text!r} is {kind}, not a regular file (writing it would replace it)"
    directory = os.path.dirname(real)
    if not os.path.isdir(directory):
        return f"{text!r}: directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{text!r}: directory {directory} is not writable"
    return None


def writable_output(path):
    """The real path to write for `path` (symlinks followed); ValueError saying why not."""
    problem = output_file_problem(path)
    if problem is not None:
        raise ValueError(problem)
    return os.path.realpath(os.path.expanduser(os.fspath(path)))
