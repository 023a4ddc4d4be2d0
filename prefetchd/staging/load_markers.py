"""Markers of loads into an offloaded model that its process did not live to finish, found
when the model is offloaded from the same store again.

prefetchd.load_param_into_net (hooks/reload.py) writes each weight in place; the store gets
the new value when the weight is written back. In the process, a load that stops part-way
is a HalfLoad and the model refuses to run until a load completes. A process killed
during a load, or after it but before its weights were all written back, left the store
holding old weights beside new ones, and a model offloaded from it later
(`offload(checkpoint=True)`) ran on that mix, saying nothing (an outside probe: kill -9
among loads of whole weight sets, 6 reopened stores of 6 held two sets).

So a load into a model whose daemon has a store_dir (one that outlives the process)
leaves a marker there while it writes: a small JSON file naming the parameters the load
writes, made durable before the first write. It is removed once every weight the load
wrote is written back and verified (`daemon.flush`), so a load that returns is durable.
`offload(checkpoint=True)` of a model whose store holds a marker for it starts half-loaded.
A model's marker is named by a digest of its parameters' names, so two models in one
store keep theirs apart. A stage (generations.stage_into) writes whole tensors: the names it
staged are no longer mixed, and leave the markers (the store's recovery ignores these
files: it reads only *.pfd and *.tmp).
"""
import contextlib
import hashlib
import json
import logging
import os

from ..errors import StorageError

log = logging.getLogger("prefetchd.staging")

PREFIX = ".pfd-load-"


def _path(store, names):
    """The marker of the model whose parameters are `names`, or None (no lasting store)."""
    if not store:
        return None
    digest = hashlib.sha256("\0".join(sorted(names)).encode()).hexdigest()[:16]
    return os.path.join(store, f"{PREFIX}{digest}.json")


def begin(store, names, pending):
    """Record durably, before a load writes anything, that `pending` (names of the model
    whose parameters are `names`) may hold old and new values until the load completes."""
    path = _path(store, names)
    if path is None:
        return
    try:
        _write(path, pending)
    except OSError as e:
        raise StorageError(f"prefetchd.load_param_into_net refused, nothing loaded: it cannot record the "
                           f"load in the store {store} ({e.strerror or e})") from None


def _write(path, pending):
    # A new file (a stage's generation may link the old one), named *.tmp so that the store's
    # recovery removes it if the process dies before the rename.
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"pending": sorted(pending)}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _sync_dir(path)


def finish(store, names):
    """The load is complete and written back: the model's marker goes."""
    path = _path(store, names)
    if path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    _sync_dir(path)


def left_by_a_crash(store, names):
    """The names a load that did not finish may have left mixed, for the model whose
    parameters are `names` ([] if its store holds no marker for it); an unreadable marker
    counts every name."""
    path = _path(store, names)
    if path is None or not os.path.exists(path):
        return []
    pending = _read(path)
    return sorted(names) if pending is None else sorted(set(pending) & set(names))


def forget_staged(store, staged):
    """A stage into `store` wrote the tensors named in `staged` whole: they leave its markers."""
    for entry in os.scandir(store):
        if entry.name.startswith(PREFIX) and entry.name.endswith(".json"):
            pending = _read(entry.path)
            left = set(pending) - set(staged) if pending is not None else None
            if left == set():
                os.unlink(entry.path)
                _sync_dir(entry.path)
            elif left is not None and left != set(pending):
                _write(entry.path, left)


def _read(path):
    """A marker's pending names, or None if it cannot be read (then every name counts)."""
    try:
        with open(path) as f:
            pending = json.load(f)["pending"]
        if not isinstance(pending, list) or not all(isinstance(n, str) for n in pending):
            raise ValueError("'pending' is not a list of names")
        return pending
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("prefetchd: the load marker %s is unreadable (%s): every parameter counts as "
                    "not loaded", path, e)
        return None


def _sync_dir(path):
    fd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
