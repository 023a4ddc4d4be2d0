"""The operators' process-wide state (prefetchd.ops): what is known of each tensor they
touched (Entry), their tiers and store (Runtime), and how a block and a remote replica
outlive exactly the references to them."""
import atexit
import shutil
import threading
import weakref

import numpy as np

from .. import _native

ALIGN = 4096
SCRATCH_PREFIX = "ops/"


class Entry:
    """What prefetchd knows about one framework tensor the operators touched."""

    __slots__ = ("tier", "block", "remote_key", "remote_crc", "remote_layout", "freed", "label")

    def __init__(self, label):
        self.tier = None           # "device" | "host" | None (no local replica)
        self.block = None          # arena or host-pool block x views
        self.remote_key = None     # store key of the remote replica
        self.remote_crc = None     # crc32c of the bytes written there
        self.remote_layout = None  # (shape, numpy dtype) they were written with
        self.freed = False
        self.label = label


class Runtime:
    """Process-wide tiers for the operators (created on first use; the store on first
    remote use, so a store problem never refuses a copy)."""

    def __init__(self):
        from ..config import Config
        config = Config.load()
        if config.store_dir:
            # A store directory is locked by the one FileStore that opens it; a
            # Daemon of this process may hold PREFETCHD_STORE_DIR, so the operators
            # keep their replicas beside it.
            config = config.replace(store_dir=config.store_dir.rstrip("/") + ".ops")
        self.config = config
        self.device = _native.Arena(config.device_budget, ALIGN)
        self.host = _native.HostPool(config.host_budget, ALIGN)
        self.stream = _native.Stream("ops")
        self.entries = {}          # id(tensor) -> Entry
        # An RLock: a gc pass inside `with lock` may collect a tensor whose finalizer
        # (forget) takes it on the same thread (a plain Lock deadlocked there).
        self.lock = threading.RLock()      # entries
        self.op_lock = threading.RLock()   # one operator at a time
        self._store = None

    @property
    def store(self):
        if self._store is None:
            from ..backend.base import open_store
            store = open_store(self.config)   # the same I/O settings a daemon uses
            # Remote replicas live as long as the tensor entries of the process that
            # wrote them; any found here are an earlier process's, which nothing can
            # name any more.
            for key in store.keys():
                if key.startswith(SCRATCH_PREFIX):
                    remove_quietly(store, key)
            if not self.config.store_dir:
                # A private temporary directory: no later process opens it to clean up, so
                # each run left its replicas (the size of every tensor still alive) in /tmp.
                atexit.register(remove_private_store, store)
            self._store = store
        return self._store


def forget(rt, key):
    """weakref callback of a collected tensor: its entry, and its remote replica, go."""
    with rt.lock:
        e = rt.entries.pop(key, None)
    if e is not None and e.remote_key is not None and rt._store is not None:
        remove_quietly(rt._store, e.remote_key)


def remove_private_store(store):
    """At exit: close the operators' store in its temporary directory and remove both."""
    directory = store.directory
    try:
        store.close()
    except Exception:    # noqa: BLE001 - closing at exit: the directory goes regardless
        pass
    shutil.rmtree(directory, ignore_errors=True)


def remove_quietly(store, key):
    try:
        store.remove(key)
    except Exception:    # noqa: BLE001 - gone already, or the store closed: nothing to free
        pass


def held(rt, pool):
    """What of `pool` only outside references keep (blocks whose tensors let go of them)."""
    device = pool is rt.device
    with rt.lock:
        blocks = {id(e.block): e.block for e in list(rt.entries.values())
                  if e.block is not None and (e.block.offset >= 0) == device}
    held = pool.used - sum(b.capacity if device else b.nbytes for b in blocks.values())
    return (f"; {held} bytes of it are kept by references to tensors already freed, detached or "
            f"reloaded (asnumpy() arrays, views, tensors sharing them): drop those") if held > 0 else ""


def bound_view(block, dtype, shape):
    """A numpy view of `block` that gives the block back to its tier when it dies: when
    nothing refers to the memory any more (the tensor bound to it, asnumpy() arrays,
    MindSpore views and tensors sharing it all keep this array alive)."""
    base = np.frombuffer(block, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)))
    weakref.finalize(base, release_block, block).atexit = False
    return base.reshape(shape)


def release_block(block):
    try:
        block.release()
    except Exception:    # noqa: BLE001 - its tier closed with the runtime: nothing to give back
        pass
