"""The hierarchical-memory operators of MindSpore's RFC, working on CPU.

Same names, arguments and meaning as `mindspore.ops.auto_generate`
(CopyToDevice, CopyToHost, Free, SetData, UpdateToDevice, UpdateToRemote,
Detach), so code written for Ascend runs unchanged here:

    copy_to_device(x, sync=False)    new tensor with x's values in the device tier
    copy_to_host(x, sync=False)      new tensor in the host tier
    free(x, sync=False)              release x's device memory in place
    set_data(x, value)               x shares value's storage from now on
    update_to_device(x, sync=False)  in place: refill x's device replica from the remote tier
    update_to_remote(x, sync=False)  in place: write x's device replica to the remote tier
    detach(x, sync=False)            in place: drop x's device replica, keep the remote one

On the CPU backend the device tier is the native arena and the remote tier the
native FileStore of a process-wide runtime (sized by `Config.load()`, i.e.
PREFETCHD_* variables). `sync=False` is accepted, but every operator has landed
its data when it returns: a MindSpore CPU kernel cannot wait on a prefetchd
event, so returning earlier would let compute read bytes still in flight. The
asynchronous path is the Daemon's prefetch queue.

A tensor whose device memory was released (free/detach) raises
UseAfterFreeError / NotResidentError when used through its Python API, and is
bound to a 0-element buffer so kernels never read memory that belongs to someone
else: a kernel that checks shapes fails, one that takes the tensor inside a
sequence (`ops.stack((y, y))`, `ops.addn`) sees it empty and returns an empty
result. Tensors that share storage (set_data) keep it until the last lets go.
"""
import threading
import uuid
import weakref

import numpy as np

from . import _native, guard
from .backend import framework
from .errors import BudgetError, NotResidentError, PrefetchdError, StorageError, UseAfterFreeError

__all__ = ["copy_to_device", "copy_to_host", "free", "set_data", "update_to_device",
           "update_to_remote", "detach", "tier", "CopyToDevice", "CopyToHost", "Free", "SetData",
           "UpdateToDevice", "UpdateToRemote", "Detach"]

_ALIGN = 4096


class _Entry:
    """What prefetchd knows about one framework tensor the operators touched."""

    __slots__ = ("tier", "block", "remote_key", "remote_crc", "shape", "dtype", "freed", "label")

    def __init__(self, shape, dtype, label):
        self.tier = None          # "device" | "host" | None (no local replica)
        self.block = None         # arena or host-pool block x views
        self.remote_key = None    # store key of the remote replica
        self.remote_crc = None    # crc32c of the bytes written there
        self.shape, self.dtype, self.label = shape, dtype, label
        self.freed = False


class _Runtime:
    """Process-wide tiers for the operators (created on first use)."""

    def __init__(self):
        from .backend.base import open_store
        from .config import Config
        config = Config.load()
        if config.store_dir:
            # A store directory is locked by the one FileStore that opens it; a
            # Daemon of this process may hold PREFETCHD_STORE_DIR, so the operators
            # keep their replicas beside it.
            config = config.replace(store_dir=config.store_dir.rstrip("/") + ".ops")
        self.device = _native.Arena(config.device_budget, _ALIGN)
        self.host = _native.HostPool(config.host_budget, _ALIGN)
        self.store = open_store(config)   # the same I/O settings a daemon uses
        self.stream = _native.Stream("ops")
        self.entries = {}         # id(tensor) -> _Entry
        self.lock = threading.Lock()


_runtime = None
_runtime_lock = threading.Lock()


def runtime():
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = _Runtime()
        return _runtime


def _entry(x, create=True):
    if not framework.is_tensor(x):
        raise TypeError(f"prefetchd.ops takes a mindspore Tensor or Parameter, not {type(x).__name__}")
    rt = runtime()
    with rt.lock:
        e = rt.entries.get(id(x))
        if e is None and create:
            arr_dtype = framework.to_numpy_dtype(x.dtype)
            e = rt.entries[id(x)] = _Entry(tuple(x.shape), arr_dtype, getattr(x, "name", None) or f"tensor@{id(x):x}")
            e.tier = "host"   # an ordinary MindSpore CPU tensor lives in framework host memory
            weakref.finalize(x, rt.entries.pop, id(x), None)
        return e


def _unmanaged(x, op):
    """The entry of `x` for an in-place operator, refused for a tensor a Daemon manages (an
    offloaded model's weight): `free` bound it to an empty buffer behind the daemon's back,
    and every later forward of the model failed with a shape error."""
    from .daemon import live_daemons
    if any(daemon.tiers_of(x) is not None for daemon in list(live_daemons)):
        name = x.__dict__.get("_prefetchd_name") or getattr(x, "name", None) or "?"
        raise PrefetchdError(f"{op}: tensor {name!r} is managed by a prefetchd Daemon (an offloaded "
                             f"model's weight, or registered): its tiers are the daemon's to move "
                             f"(daemon.prefetch / evict / use); prefetchd.ops moves tensors no "
                             f"daemon manages")
    return _entry(x)


def _check_usable(x, e, op):
    if e.freed:
        raise UseAfterFreeError(e.label, ",".join(_tiers(e)), "freed",
                                f"{op}: tensor {e.label!r} was freed by prefetchd.ops.free()")
    if e.tier is None:
        raise NotResidentError(e.label, ",".join(_tiers(e)), "detached",
                               f"{op}: tensor {e.label!r} has no device or host replica "
                               f"(detached; call update_to_device first)")


def _values(x, e, op):
    _check_usable(x, e, op)
    return framework.host_copy(x)   # waits for compute still writing x


def _place(pool, array):
    """A new block of `pool` holding array's bytes (copied on the ops stream)."""
    rt = runtime()
    block = _alloc(pool, array.nbytes)
    if array.nbytes:
        rt.stream.copy(block, np.ascontiguousarray(array), array.nbytes).synchronize()
    return block


def _alloc(pool, nbytes):
    try:
        return pool.alloc(nbytes)
    except _native.OutOfSpace as e:
        tier = "device" if pool is runtime().device else "host"
        raise BudgetError(f"prefetchd.ops: no room for {nbytes} bytes in the {tier} tier ({e}); "
                          f"free tensors, or raise PREFETCHD_{tier.upper()}_BUDGET") from None


def _new_tensor(array, tier_name):
    rt = runtime()
    pool = rt.device if tier_name == "device" else rt.host
    block = _place(pool, array)
    view = np.frombuffer(block, dtype=array.dtype, count=array.size).reshape(array.shape)
    out = framework.mindspore().Tensor.from_numpy(view)
    e = _entry(out)
    e.tier, e.block = tier_name, block
    return out


def copy_to_device(x, sync=False):
    """A new tensor with x's shape, dtype and values, in the device tier."""
    return _new_tensor(_values(x, _entry(x), "copy_to_device"), "device")


def copy_to_host(x, sync=False):
    """A new tensor with x's shape, dtype and values, in the host tier."""
    return _new_tensor(_values(x, _entry(x), "copy_to_host"), "host")


def free(x, sync=False):
    """Release x's device memory in place. Later use raises UseAfterFreeError."""
    e = _unmanaged(x, "free")
    if e.freed:
        raise UseAfterFreeError(e.label, "", "freed", f"free: tensor {e.label!r} was already freed")
    _release_local(x, e)
    e.freed = True
    e.remote_key = None
    guard.guard(x, lambda: UseAfterFreeError(e.label, "", "freed",
                                              f"tensor {e.label!r} was freed by prefetchd.ops.free()"))
    return x


def _release_local(x, e):
    # Compute dispatched earlier may still read x's memory (MindSpore is
    # asynchronous on CPU): fence before giving the block back.
    framework.synchronize()
    framework.bind_placeholder(x, e.dtype)
    block, e.block, e.tier = e.block, None, None
    _let_go(block)


def _let_go(block):
    """Give `block` back unless another tensor still uses it (set_data shares blocks): the
    last one to let go releases it. The caller fenced compute and took its entry off it."""
    if block is None:
        return
    rt = runtime()
    with rt.lock:
        shared = any(other.block is block for other in rt.entries.values())
    if not shared:
        block.release()


def set_data(x, value):
    """From now on x shares value's storage: writes through either are seen by both.
    Releasing it through one of them (free, detach, update_to_device) lets go of it for
    that one only; the storage goes when the last tensor sharing it lets go."""
    ev = _unmanaged(value, "set_data")
    _check_usable(value, ev, "set_data")
    ex = _unmanaged(x, "set_data")
    if guard.is_guarded(x):
        guard.release(x)
    framework.share(x, value)
    old = ex.block
    ex.tier, ex.block, ex.freed = ev.tier, ev.block, False
    ex.shape, ex.dtype = ev.shape, ev.dtype
    ex.remote_key = ex.remote_crc = None
    if old is not None and old is not ev.block:
        framework.synchronize()      # compute dispatched on x may still read its old block
        _let_go(old)
    return x


def update_to_remote(x, sync=False):
    """Write x's device replica to the remote tier; both replicas are valid afterwards."""
    e = _unmanaged(x, "update_to_remote")
    array = np.ascontiguousarray(_values(x, e, "update_to_remote"))
    rt = runtime()
    key = e.remote_key or f"ops/{uuid.uuid4().hex}"
    crc = _native.crc32c(array)
    try:
        rt.store.write_sync(key, array, array.nbytes, b"")
    except _native.NativeError as err:
        raise StorageError(f"update_to_remote({e.label!r}) failed; the device replica is intact: {err}") from err
    e.remote_key, e.remote_crc = key, crc
    return x


def detach(x, sync=False):
    """Drop x's device replica, keeping the remote one.

    Refuses — and changes nothing — unless the remote replica holds exactly
    x's current values (checked by checksum), so nothing written is lost.
    """
    e = _unmanaged(x, "detach")
    array = _values(x, e, "detach")
    if e.remote_key is None:
        raise StorageError(f"detach({e.label!r}) refused: it has no remote replica "
                           f"(call update_to_remote first); nothing was dropped")
    if _remote_stale(array, e):
        raise StorageError(f"detach({e.label!r}) refused: the tensor changed since update_to_remote, "
                           f"so the remote replica is stale; nothing was dropped")
    _release_local(x, e)
    guard.guard(x, lambda: NotResidentError(e.label, "remote", "detached"))
    return x


def _remote_stale(array, e):
    """x's values (`array`) differ from what update_to_remote wrote (by checksum)."""
    return _native.crc32c(np.ascontiguousarray(array)) != e.remote_crc


def update_to_device(x, sync=False):
    """Refill x's device replica from its remote replica (verified by checksum)."""
    e = _unmanaged(x, "update_to_device")
    if e.freed:
        _check_usable(x, e, "update_to_device")
    if e.remote_key is None:
        raise NotResidentError(e.label, ",".join(_tiers(e)), "no remote replica",
                               f"update_to_device({e.label!r}): it has no remote replica to load from")
    rt = runtime()
    count = int(np.prod(e.shape)) if e.shape else 1
    block = _alloc(rt.device, count * e.dtype.itemsize)
    try:
        rt.store.read_sync(e.remote_key, block, True)
    except _native.NativeError as err:
        block.release()
        raise StorageError(f"update_to_device({e.label!r}) failed: {err}") from err
    view = np.frombuffer(block, dtype=e.dtype, count=count).reshape(e.shape)
    if guard.is_guarded(x):
        guard.release(x)
    old = e.block
    framework.bind(x, view)
    e.tier, e.block = "device", block
    if old is not None:
        framework.synchronize()
        _let_go(old)
    return x


def _tiers(e):
    out = [e.tier] if e.tier else []
    if e.remote_key is not None:
        out.append("remote")
    return tuple(out)


def tier(x):
    """Where x's valid replicas are, fastest first: e.g. ("device",), ("device", "remote"), ().

    Tensors a Daemon manages report the daemon's view; an ordinary MindSpore
    CPU tensor is ("host",).
    """
    if not framework.is_tensor(x):
        raise TypeError(f"tier() takes a mindspore Tensor or Parameter, not {type(x).__name__}")
    from .daemon import live_daemons
    for daemon in list(live_daemons):
        tiers = daemon.tiers_of(x)
        if tiers is not None:
            return tiers
    e = _entry(x, create=False)
    if e is not None:
        if e.tier is not None and e.remote_key is not None and not e.freed and \
                _remote_stale(framework.host_copy(x), e):
            return (e.tier,)     # written since update_to_remote: the remote replica is stale
        return _tiers(e)
    if guard.is_managed(x):
        return ()                # its daemon closed: no replica is reachable through it
    return ("host",)


class _Primitive:
    """Primitive-style callables mirroring mindspore.ops.auto_generate."""

    _fn = None

    def __call__(self, *args, **kwargs):
        return type(self)._fn(*args, **kwargs)


def _primitive(name, fn):
    return type(name, (_Primitive,), {"_fn": staticmethod(fn), "__doc__": fn.__doc__})


CopyToDevice = _primitive("CopyToDevice", copy_to_device)
CopyToHost = _primitive("CopyToHost", copy_to_host)
Free = _primitive("Free", free)
SetData = _primitive("SetData", set_data)
UpdateToDevice = _primitive("UpdateToDevice", update_to_device)
UpdateToRemote = _primitive("UpdateToRemote", update_to_remote)
Detach = _primitive("Detach", detach)
