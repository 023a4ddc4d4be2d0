"""What a `prefetchd serve` front killed with SIGKILL leaves behind, removed by the next front
to start.

A front makes, and removes when it stops: a temporary store directory when it has no
--store (`.prefetchd-serve-*` beside the --checkpoint-store, whose worker stores hard-link
the checkpoint's files and keep an old checkpoint's blocks on disk after a new stage; else
`prefetchd-serve-*` in the temporary directory, holding the weights its workers wrote), and
ipc sockets in the runtime directory named `<name>-<pid>-<hex4>-{w<i>,work,host}[-events].sock`.
After a SIGKILL nothing removes them, and restarts never did.

A temporary store is removed when no front holds its serve lock; one without a lock file
only once older than MIN_AGE_SECONDS (a front creates the directory a moment before it
locks it). A socket is removed when its front's pid is not running. In a --store the front holds,
workers' stores no daemon holds are removed (remove_dead_worker_stores).
"""
import logging
import os
import re
import shutil
import stat
import tempfile
import time

from ..backend.base import STORE_LOCK
from ..staging.generations import lock_or_holder

log = logging.getLogger("prefetchd.serve")

MIN_AGE_SECONDS = 60.0
# tempfile.mkdtemp's names (ServeSpec.with_temporary_store): nothing else is touched.
_NEAR_CHECKPOINT = re.compile(r"\.prefetchd-serve-[a-z0-9_]{8}$")
_IN_TMP = re.compile(r"prefetchd-serve-[a-z0-9_]{8}$")
_WORKER_ENTRY = re.compile(r"(worker-\d+-\d+|shared-host-.+)$")   # what a front puts in one
_WORKER_STORE = re.compile(r"worker-\d+-\d+$")
_SHARED_STORE = re.compile(r"shared-host-.+-\d+-[0-9a-f]{4}$")     # sharedhost.serving: its front's tag
_SOCKET = re.compile(r"-(\d+)-[0-9a-f]{4}-(?:w\d+|work|host)(?:-events)?\.sock$")


def remove_leftovers(checkpoint_store, runtime_dir, lock_name):
    """Remove dead fronts' temporary stores (beside `checkpoint_store`, or in the temporary
    directory) and sockets (in `runtime_dir`); returns what was removed."""
    near = os.path.dirname(os.path.realpath(checkpoint_store)) if checkpoint_store else tempfile.gettempdir()
    made = _NEAR_CHECKPOINT if checkpoint_store else _IN_TMP
    removed = [p for p in _entries(near, "") if made.match(os.path.basename(p))
               and _remove_unlocked_store(p, lock_name)]
    removed += [p for p in _entries(runtime_dir, "") if _SOCKET.search(p) and _remove_dead_socket(p)]
    for path in removed:
        log.info("prefetchd serve: removed %s, left by a server that was killed", path)
    return removed


def remove_dead_worker_stores(store_dir):
    """Worker stores (`worker-<index>-<generation>`) in the --store this front now holds
    (front_sockets.hold_store) whose daemon is gone (their FileStore lock is free): a
    front killed with SIGKILL left them (its workers exit once orphaned), and nothing
    removed them; one whose lock file is not there yet only once older than
    MIN_AGE_SECONDS. Returns what was removed."""
    removed = []
    # ...and the shared host tier's store (`shared-host-<front tag>`): the owner's FileStore
    # holds the same lock, and one accumulated per killed front.
    for path in _entries(store_dir, "worker-") + _entries(store_dir, "shared-host-"):
        name = os.path.basename(path)
        if (_WORKER_STORE.match(name) or _SHARED_STORE.match(name)) and _remove_unlocked_store(path, STORE_LOCK):
            removed.append(path)
            log.info("prefetchd serve: removed %s, left by a server that was killed", path)
    return removed


def _entries(directory, prefix):
    try:
        return [os.path.join(directory, n) for n in os.listdir(directory) if n.startswith(prefix)]
    except OSError:
        return []


def _remove_unlocked_store(path, lock_name):
    lock = os.path.join(path, lock_name)
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return False
        if not os.path.exists(lock) and (time.time() - st.st_mtime < MIN_AGE_SECONDS or not all(
                _WORKER_ENTRY.match(n) for n in os.listdir(path))):
            return False                          # a front's that it has not locked yet, or not a front's
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    if lock_or_holder(fd) is not None:            # a live front's (and fd is closed)
        return False
    try:
        shutil.rmtree(path, ignore_errors=True)
    finally:
        os.close(fd)
    return not os.path.exists(path)


def _remove_dead_socket(path):
    pid = int(_SOCKET.search(path).group(1))
    try:
        os.kill(pid, 0)
        return False                             # running (or another process has its pid)
    except ProcessLookupError:
        pass
    except PermissionError:
        return False
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
