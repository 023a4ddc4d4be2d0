"""Registration: a framework tensor (or a stored tensor) becomes a managed record.

`Registrar.register` copies the tensor's values once, adds its record, gives it a
home where the backend has stable addresses, and hands the values to the scheduler
(a REGISTER request: a device replica, a host block, or a verified write to the
store); once placed, the framework tensor is bound to its replica or made a
placeholder. A failed placement forgets the record: nothing half-registered stays.
`register_all` places many tensors before any is taken over: all, or none (the
placed ones are forgotten again when one fails).
`register_remote` manages a tensor whose bytes are already in the store (its file is the
user's: forgetting the record leaves it).
Any thread; the registry changes under the daemon's lock.
"""
import logging

import numpy as np

from .. import dtypes
from ..backend import framework
from ..errors import UnknownTensorError
from .records import ManagedTensor
from .registry import check_name
from .requests import Kind, Request
from .waits import RequestFuture, refuse_wait_on_scheduler

TIERS = ("device", "host", "remote")

log = logging.getLogger("prefetchd")


def checked_name(tensor, name, tier):
    """The name `tensor` registers under; ValueError/TypeError for a bad tier or tensor."""
    if tier not in TIERS:
        raise ValueError(f"tier must be 'device', 'host' or 'remote', not {tier!r}")
    if not framework.is_tensor(tensor):
        raise TypeError(f"register() takes a mindspore Tensor or Parameter, not {type(tensor).__name__}")
    return check_name(name if name is not None else getattr(tensor, "name", None))


def _checked_layout(name, shape, dtype):
    """(shape tuple, np.dtype) of register_remote's arguments, or a TypeError/ValueError
    naming the tensor: a shape of non-negative integers, a dtype prefetchd stores."""
    try:
        dims = tuple(shape)
    except TypeError:
        dims = None
    if dims is None or isinstance(shape, (str, bytes)) or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) and d >= 0 for d in dims):
        raise ValueError(f"register_remote({name!r}): shape must be a sequence of non-negative "
                         f"integers, not {shape!r}")
    try:
        dtype_name = dtypes.name_of(dtype)
        known = dtype_name in dtypes.ITEMSIZE
    except TypeError:
        known = False
    if not known:
        raise TypeError(f"register_remote({name!r}): dtype {dtype!r} is not one prefetchd stores "
                        f"({', '.join(dtypes.ITEMSIZE)})")
    return tuple(int(d) for d in dims), dtypes.numpy_dtype(dtype_name)


def _check_target(name, target, shape, dtype_name):
    """A target of another shape or dtype would be bound to bytes laid out for this one."""
    have = (tuple(int(d) for d in target.shape), dtypes.known_name(target.dtype))
    if have != (shape, dtype_name):
        raise ValueError(f"register_remote({name!r}): target is shape {list(have[0])} of {have[1]}, the "
                         f"tensor registered is shape {list(shape)} of {dtype_name}: pass a target of that "
                         f"shape and dtype")


class Registrar:
    def __init__(self, core, registry, homes, binding):
        self._core = core              # submit, lock, backend
        self._registry = registry
        self._homes = homes            # HomeSpace where the backend has stable addresses, else None
        self._binding = binding

    def register(self, tensor, name, tier):
        """The record of `tensor` under `name`, placed on `tier` (see the module docstring);
        name and tier as checked_name returned and checked them."""
        rec = self._place(tensor, name, tier)
        self._take_over(rec, tier)
        return rec

    def register_all(self, items, tier):
        """Records of every (tensor, name) in `items`, placed on tier "host" or "remote";
        or none. Every tensor keeps its own memory until all are placed, so when one
        placement fails (a full disk) the placed ones are forgotten (host blocks freed,
        store files removed) and every tensor is as it was; the error is re-raised."""
        if tier not in ("host", "remote"):
            raise ValueError(f"register_all places on the 'host' or 'remote' tier, not {tier!r}")
        recs = []
        try:
            for tensor, name in items:
                recs.append(self._place(tensor, name, tier))
        except BaseException:
            if recs:
                try:
                    self._core.submit(Request(Kind.FORGET, tuple(recs), RequestFuture())).result()
                except Exception as e:     # the daemon closing: the first error is the one to see
                    log.warning("prefetchd: %d placed tensors not forgotten after a failed "
                                "registration: %s", len(recs), e)
            raise
        for rec in recs:
            self._take_over(rec, tier)
        return recs

    def _place(self, tensor, name, tier):
        """A new record holding a copy of `tensor`'s values on `tier`; `tensor` unchanged."""
        refuse_wait_on_scheduler("register()", self._core)      # it waits for the placement
        with self._core.lock:
            self._registry.refuse_taken(name, tensor)
        # np.require, not np.ascontiguousarray: that makes a 0-d tensor 1-d
        array = np.require(framework.host_copy(tensor), requirements="C")
        rec = ManagedTensor(name=name, shape=tuple(array.shape), dtype=array.dtype,
                            nbytes=array.nbytes, target=tensor)
        self._add(rec)
        try:
            self._core.submit(Request(Kind.REGISTER, (rec,), RequestFuture(), args=(array, tier))).result()
        except BaseException:
            with self._core.lock:
                self._registry.forget(rec)
            raise
        return rec

    def _take_over(self, rec, tier):
        """Point the framework tensor at what the daemon manages: its device replica, or
        its home (a placeholder that faults until loaded); its own memory is let go."""
        if tier == "device":
            if rec.home is not None:
                self._binding.bind_home(rec)
            self._binding.bind_for_compute((rec,))
            self._binding.track(rec)
        else:
            self._binding.placeholder(rec)

    def register_remote(self, name, shape, dtype, target):
        """The record of the stored tensor `name` (a checked name), checked against shape and
        dtype; every argument is checked before anything is registered."""
        shape, dtype = _checked_layout(name, shape, dtype)
        if target is not None and not framework.is_tensor(target):
            raise TypeError(f"register_remote({name!r}): target must be a mindspore Tensor or "
                            f"Parameter, not {type(target).__name__}")
        with self._core.lock:           # said before the store is asked (probe K)
            self._registry.refuse_taken(name, target)
        backend = self._core.backend
        if not backend.store_contains(name):
            raise UnknownTensorError(f"the store has no tensor named {name!r}")
        info = backend.store_info(name)
        nbytes = dtypes.nbytes(shape, dtype.name)
        stored = dtypes.meta_layout(info.get("meta"))
        if stored is not None and stored != (shape, dtype.name):
            raise ValueError(f"register_remote({name!r}): the store holds shape {list(stored[0])} of "
                             f"{stored[1]}, not shape {list(shape)} of {dtype.name} (its bytes would be "
                             f"read as another tensor)")
        if info["nbytes"] != nbytes:
            raise ValueError(f"{name!r}: the store holds {info['nbytes']} bytes, "
                             f"but shape {shape} of {dtype} needs {nbytes}")
        if target is not None:
            _check_target(name, target, shape, dtype.name)
        rec = ManagedTensor(name=name, shape=shape, dtype=dtype, nbytes=nbytes,
                            target=target, remote_valid=True, keeps_store_file=True)
        self._add(rec)
        if target is not None:
            try:
                self._binding.placeholder(rec)
            except BaseException:
                with self._core.lock:
                    self._registry.forget(rec)
                raise
        return rec

    def _add(self, rec):
        with self._core.lock:
            self._registry.add(rec)
            rec.home = self._homes.carve(rec.nbytes) if self._homes is not None else None
