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
bound to a 0-element buffer: a kernel that checks shapes fails, one that takes
the tensor inside a sequence (`ops.stack((y, y))`, `ops.addn`) sees it empty and
returns an empty result. A block goes back to its tier only when nothing refers
to its memory any more: arrays from `asnumpy()`, MindSpore views and tensors that
share it (set_data, `Parameter.set_data`) keep it, and keep reading the values it
had, so no alias ever reads the next tensor's bytes. The remote replica records
the shape and dtype it was written with; `update_to_device` restores both.
Operators run one at a time (one process-wide lock).
"""
import functools
import os
import threading
import uuid
import weakref

import numpy as np

from .. import _native, guard
from ..backend import framework
from ..errors import BudgetError, IntegrityError, NotResidentError, PrefetchdError, StorageError, UseAfterFreeError
from .runtime import SCRATCH_PREFIX, Entry, Runtime, bound_view, forget, held, remove_quietly

__all__ = ["copy_to_device", "copy_to_host", "free", "set_data", "update_to_device",
           "update_to_remote", "detach", "tier", "CopyToDevice", "CopyToHost", "Free", "SetData",
           "UpdateToDevice", "UpdateToRemote", "Detach"]

_runtime = None
_runtime_lock = threading.Lock()


def runtime():
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = Runtime()
        return _runtime


_forked_away = []     # a forked child's copy of its parent's runtime, never to be torn down


def _forked_child():
    """A fork copies the runtime without its copy stream's thread, and its locks as they
    were, possibly held by a thread the child does not have: the child's first operator
    waited for good. The child starts a runtime of its own on first use (its store is the
    parent's, which refuses a second opener: remote operators say so); the parent's copy is
    kept, never closed (its teardown would wait for threads that are not there)."""
    global _runtime, _runtime_lock
    _runtime_lock = threading.Lock()
    if _runtime is not None:
        _forked_away.append(_runtime)
        _runtime = None


os.register_at_fork(after_in_child=_forked_child)


def _one_at_a_time(fn):
    """Run operator `fn` under the runtime's operator lock: a free racing an
    update_to_device of the same tensor left it marked freed yet bound to a live block."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        with runtime().op_lock:
            return fn(*args, **kwargs)
    return run


def _check_tensor(x):
    if not framework.is_tensor(x):
        raise TypeError(f"prefetchd.ops takes a mindspore Tensor or Parameter, not {type(x).__name__}")


def _entry(x, create=True):
    _check_tensor(x)
    rt = runtime()
    with rt.lock:
        e = rt.entries.get(id(x))
        if e is None and create:
            e = rt.entries[id(x)] = Entry(getattr(x, "name", None) or f"tensor@{id(x):x}")
            e.tier = "host"   # an ordinary MindSpore CPU tensor lives in framework host memory
            weakref.finalize(x, forget, rt, id(x)).atexit = False
        return e


def _unmanaged(x, op):
    """The entry of `x` for an in-place operator, refused for a tensor a Daemon manages (an
    offloaded model's weight): `free` bound it to an empty buffer behind the daemon's back,
    and every later forward of the model failed with a shape error."""
    from ..daemon import live_daemons
    _check_tensor(x)
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
    """x's values (numpy, a view on CPU), refused for a tensor the operators released.
    `e` None: a tensor they never touched (read as it is; no entry is made for a source)."""
    _check_tensor(x)
    if e is not None:
        _check_usable(x, e, op)
    return framework.host_copy(x)   # waits for compute still writing x


def _alloc(pool, nbytes):
    try:
        return pool.alloc(nbytes)
    except _native.OutOfSpace as e:
        tier = "device" if pool is runtime().device else "host"
        raise BudgetError(f"prefetchd.ops: no room for {nbytes} bytes in the {tier} tier ({e}){held(runtime(), pool)}; "
                          f"free tensors, or raise PREFETCHD_{tier.upper()}_BUDGET") from None


def _new_tensor(array, tier_name):
    rt = runtime()
    pool = rt.device if tier_name == "device" else rt.host
    block = _alloc(pool, array.nbytes)
    if array.nbytes:
        rt.stream.copy(block, np.ascontiguousarray(array), array.nbytes).synchronize()
    out = framework.mindspore().Tensor.from_numpy(bound_view(block, array.dtype, array.shape))
    e = _entry(out)
    e.tier, e.block = tier_name, block
    return out


@_one_at_a_time
def copy_to_device(x, sync=False):
    """A new tensor with x's shape, dtype and values, in the device tier."""
    return _new_tensor(_values(x, _entry(x, create=False), "copy_to_device"), "device")


@_one_at_a_time
def copy_to_host(x, sync=False):
    """A new tensor with x's shape, dtype and values, in the host tier."""
    return _new_tensor(_values(x, _entry(x, create=False), "copy_to_host"), "host")


@_one_at_a_time
def free(x, sync=False):
    """Release x's device memory in place. Later use raises UseAfterFreeError."""
    e = _unmanaged(x, "free")
    if e.freed:
        raise UseAfterFreeError(e.label, "", "freed", f"free: tensor {e.label!r} was already freed")
    _release_local(x, e)
    e.freed = True
    if e.remote_key is not None:
        remove_quietly(runtime().store, e.remote_key)
    e.remote_key = e.remote_crc = e.remote_layout = None
    guard.guard(x, lambda: UseAfterFreeError(e.label, "", "freed",
                                              f"tensor {e.label!r} was freed by prefetchd.ops.free()"),
                name=e.label)
    return x


def _release_local(x, e):
    # Compute dispatched earlier may still read x's memory (MindSpore is
    # asynchronous on CPU): fence before x lets go of it. The block itself goes
    # back when the last reference to its memory dies (_bound_view).
    framework.synchronize()
    framework.bind_placeholder(x, framework.to_numpy_dtype(x.dtype))
    e.block, e.tier = None, None


@_one_at_a_time
def set_data(x, value):
    """From now on x shares value's storage: writes through either are seen by both.
    Releasing it through one of them (free, detach, update_to_device) lets go of it for
    that one only; the storage goes when nothing refers to it any more."""
    ev = _unmanaged(value, "set_data")
    _check_usable(value, ev, "set_data")
    ex = _unmanaged(x, "set_data")
    if isinstance(x, framework.mindspore().Parameter) and x.dtype != value.dtype:
        # Parameter.set_data casts a value of another dtype into a copy: x would not
        # share value's storage, and what the entries say about x would be false.
        raise TypeError(f"set_data: Parameter {ex.label!r} is {x.dtype} and the value is {value.dtype}: "
                        f"MindSpore would cast it into a copy, so they could not share storage; "
                        f"cast the value first (value.astype({x.dtype}))")
    if guard.is_guarded(x):
        guard.release(x)
    framework.synchronize()          # compute dispatched on x may still read its old memory
    framework.share(x, value)
    ex.tier, ex.block, ex.freed = ev.tier, ev.block, False
    if ex.remote_key is not None:
        remove_quietly(runtime().store, ex.remote_key)
    ex.remote_key = ex.remote_crc = ex.remote_layout = None
    return x


@_one_at_a_time
def update_to_remote(x, sync=False):
    """Write x's device replica to the remote tier; both replicas are valid afterwards."""
    e = _unmanaged(x, "update_to_remote")
    values = _values(x, e, "update_to_remote")
    array = np.ascontiguousarray(values)      # (at least 1-d: the layout is values')
    rt = runtime()
    key = e.remote_key or f"{SCRATCH_PREFIX}{uuid.uuid4().hex}"
    crc = _native.crc32c(array)
    try:
        rt.store.write_sync(key, array, array.nbytes, b"")
    except _native.NativeError as err:
        raise StorageError(f"update_to_remote({e.label!r}) failed; the device replica is intact: {err}") from err
    e.remote_key, e.remote_crc, e.remote_layout = key, crc, (values.shape, values.dtype)
    return x


@_one_at_a_time
def detach(x, sync=False):
    """Drop x's device replica, keeping the remote one.

    Refuses — and changes nothing — unless the remote replica holds exactly
    x's current values, shape and dtype (values checked by checksum), so nothing
    written is lost.
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
    guard.guard(x, lambda: UseAfterFreeError(
        e.label, "remote", "detached", f"tensor {e.label!r} was detached by prefetchd.ops.detach(): "
                                       f"only its remote replica is left (prefetchd.ops.update_to_device "
                                       f"loads it back)"), name=e.label)
    return x


def _remote_stale(array, e):
    """x's values (`array`) differ from what update_to_remote wrote: in shape, dtype or
    bytes (by checksum)."""
    shape, dtype = e.remote_layout
    return (tuple(array.shape), array.dtype) != (tuple(shape), dtype) or \
        _native.crc32c(np.ascontiguousarray(array)) != e.remote_crc


@_one_at_a_time
def update_to_device(x, sync=False):
    """Refill x's device replica from its remote replica (verified by checksum), with the
    shape and dtype it was written with. A resident x that still has that layout and a
    block of its own is refilled in place: its address stays, so a @jit graph compiled
    against it reads the new values."""
    e = _unmanaged(x, "update_to_device")
    if e.freed:
        _check_usable(x, e, "update_to_device")
    if e.remote_key is None:
        raise NotResidentError(e.label, ",".join(_tiers(e)), "no remote replica",
                               f"update_to_device({e.label!r}): it has no remote replica to load from")
    rt = runtime()
    shape, dtype = e.remote_layout
    block = _alloc(rt.device, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    try:
        rt.store.read_sync(e.remote_key, block, True)
    except (_native.NativeError, ValueError) as err:
        block.release()
        # A checksum mismatch is an IntegrityError here as from the daemon's loads.
        kind = IntegrityError if isinstance(err, _native.ChecksumMismatch) else StorageError
        raise kind(f"update_to_device({e.label!r}) failed, {x.dtype} {tuple(x.shape)} left as it "
                   f"was: {err}") from err
    if _refill_in_place(x, e, block, shape, dtype):
        block.release()
        return x
    if guard.is_guarded(x):
        guard.release(x)
    framework.synchronize()          # compute dispatched on x may still read its old memory
    framework.bind(x, bound_view(block, dtype, shape))
    e.tier, e.block = "device", block
    return x


def _refill_in_place(x, e, loaded, shape, dtype):
    """Copy `loaded` over x's own device block if x is resident there with that layout."""
    if e.tier != "device" or e.block is None or guard.is_guarded(x) or \
            (tuple(x.shape), framework.to_numpy_dtype(x.dtype)) != (tuple(shape), dtype):
        return False
    rt = runtime()
    with rt.lock:
        shared = any(other is not e and other.block is e.block for other in list(rt.entries.values()))
    # (x may have been rebound behind the operators' back: MindSpore's assign_value)
    viewed = framework.host_copy(x).__array_interface__["data"][0] if loaded.nbytes else e.block.address
    if shared or e.block.nbytes != loaded.nbytes or viewed != e.block.address:
        return False
    framework.synchronize()          # compute dispatched on x may still read or write it
    if loaded.nbytes:
        rt.stream.copy(e.block, loaded, loaded.nbytes).synchronize()
    return True


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
    from ..daemon import live_daemons
    for daemon in list(live_daemons):
        tiers = daemon.tiers_of(x)
        if tiers is not None:
            return tiers
    with runtime().op_lock:      # (an operator may be changing the entry meanwhile)
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
