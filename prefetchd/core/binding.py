"""The compute-thread side: framework tensors <-> device replicas, and the user's writes.

Binding a MindSpore Parameter to new storage (set_data) waits for the whole
op queue to drain if the old storage was used by an op, so it happens on the
compute thread, never on the scheduler. Python-level use of a tensor whose
replica is gone is refused by a class-swap guard (prefetchd/guard.py); writes
through the Python API mark the tensor dirty so the write-back keeps them.
"""
import numpy as np

from .. import dtypes, guard as guards
from ..backend import framework
from ..errors import DaemonClosedError, NotResidentError, PrefetchdError
from .records import State


def _refused(rec, closed_as):
    """The error the guard raises for `rec`'s tensor. Raised inside a function a gradient
    records (an L2 term on a weight in a loss), it would leave PyNative recording for good,
    and later forwards and gradients failed: the recording is abandoned first."""
    framework.abandon_grad()
    return _not_in_use(rec, closed_as)


def _not_in_use(rec, closed_as):
    if rec.index is None and closed_as is None:    # forgotten: Daemon.unregister, handle.close()
        return DaemonClosedError(rec.name, "", "unregistered", (
            f"tensor {rec.name!r} was unregistered from its daemon (its offloaded model's handle was "
            f"closed, or Daemon.unregister): its values are gone from it; build the model again "
            f"(from its checkpoint, or with prefetchd.offload(model, daemon, checkpoint=True) from a "
            f"staged store)"))
    if closed_as is not None:
        # daemon.use cannot help any more: say what can
        return DaemonClosedError(rec.name, ",".join(rec.tiers), rec.state.value, (
            f"tensor {rec.name!r} was managed by {closed_as}; its values are not reachable through "
            f"it any more: build the model again (from its checkpoint, or with prefetchd.offload(model, "
            f"Daemon(store_dir=...), checkpoint=True) on the store its weights were written to)"))
    if rec.state is State.RESIDENT:   # resident by chance (a prefetch), but nobody holds it
        return NotResidentError(rec.name, ",".join(rec.tiers), rec.state.value, (
            f"tensor {rec.name!r} is managed by prefetchd and not in use: it may move at any "
            f"moment, so Python-level use is refused outside an offloaded model's forward; "
            f"use it inside `with daemon.use([...])`"))
    return NotResidentError(rec.name, ",".join(rec.tiers), rec.state.value)


class Binding:
    def __init__(self, lock, backend, stats):
        self._lock = lock
        self._backend = backend
        self._stats = stats
        self.closed_as = None      # the daemon's closed message, once it closes
        self.bound_for_compute = False   # some tensor was handed to compute (Daemon.close waits for it)

    def bind_home(self, rec):
        """Point the framework tensor at its home, once for its life (no copy)."""
        if rec.target is not None:
            self._backend.bind(rec.target, rec.home, rec.shape, rec.dtype)
            rec.bound_address = rec.home.address

    def bind_for_compute(self, records):
        """Point each record's framework tensor at its device replica (on the calling thread).

        One lock round for all of them, whatever their number; the rare rebinds (tensors
        without a home whose replica moved) run after it, outside the lock.
        """
        rebinds = []
        self.bound_for_compute = True
        with self._lock:
            for rec in records:
                if rec.target is None:
                    continue
                block = rec.block
                if block is None:
                    raise NotResidentError(rec.name, ",".join(rec.tiers), rec.state.value)
                if rec.home is None and rec.bound_address != block.address:
                    rebinds.append((rec, block))
                rec.exposed = True
                rec.compute_epoch = None     # read by compute from now on, until a fence says otherwise
        moved = 0
        for rec, block in rebinds:
            self._backend.bind(rec.target, block, rec.shape, rec.dtype)
            moved += bool(rec.bound_address)
            rec.bound_address = block.address
        if moved:
            with self._lock:
                self._stats.rebinds += moved
        for rec in records:
            if rec.target is not None and guards.is_guarded(rec.target):
                self.track(rec)

    def track(self, rec):
        guards.track(rec.target, rec.name, lambda method, rec=rec: self.on_user_write(rec, method),
                     lambda method, args, kwargs, rec=rec: check_layout_kept(rec, method, args, kwargs))

    def guard(self, rec):
        """Python-level use of rec's tensor raises NotResidentError until it is bound again."""
        if rec.target is not None:
            guards.guard(rec.target, lambda rec=rec: _refused(rec, self.closed_as), rec.name)

    def placeholder(self, rec):
        """A registered tensor whose data lives elsewhere: bound to its home (which
        faults on reads until a replica is attached), or to a 0-element stand-in on
        a backend without homes; guarded either way."""
        if rec.home is not None:
            self.bind_home(rec)
        else:
            framework.bind_placeholder(rec.target, rec.dtype)
        self.guard(rec)

    def on_user_write(self, rec, method):
        """The user wrote a managed tensor through its Python API (caller's thread)."""
        if method in ("set_data", "assign_value"):
            self._adopt(rec)
        with self._lock:
            if rec.state in (State.RESIDENT, State.STORING):
                rec.dirty = True
                rec.generation += 1

    def _adopt(self, rec):
        """The user gave the tensor new storage: copy its values into the device
        replica and point the tensor back at it, so the write-back keeps them."""
        values = framework.host_copy(rec.target)
        with self._lock:
            replica = rec.replica if rec.block is not None else None
            if replica is None or values.nbytes != rec.nbytes:
                raise PrefetchdError(
                    f"{rec.name!r} is managed by prefetchd: set_data must keep its shape and dtype "
                    f"({rec.shape}, {rec.dtype}); got {values.shape}, {values.dtype}")
            view = self._backend.view(replica, rec.shape, rec.dtype)
        view[...] = values.reshape(rec.shape)
        self._backend.bind(rec.target, replica, rec.shape, rec.dtype)
        rec.bound_address = replica.address

    @staticmethod
    def release_all(records):
        """At close: resident tensors keep viewing their block (the native arena stays
        mapped while any view of it lives); give them back their own class."""
        for rec in records:
            if rec.target is not None and rec.state is State.RESIDENT:
                guards.release(rec.target)


def check_layout_kept(rec, method, args, kwargs):
    """PrefetchdError, before MindSpore applies it, for a write that would change a managed
    tensor's shape or dtype: the daemon's memory and write-back are laid out for them
    (Parameter.set_data casts a value of another dtype itself; assign_value, and a plain
    Tensor, take it on)."""
    if method == "set_dtype":
        wanted = args[0] if args else kwargs.get("data_type")
        if dtypes.known_name(wanted) == rec.dtype.name:
            return
        got = f"dtype {wanted}"
    else:
        value = args[0] if args else kwargs.get("data", kwargs.get("value"))
        shape = tuple(int(d) for d in getattr(value, "shape", np.shape(value)))
        dtype = getattr(value, "dtype", None)
        casts = method == "set_data" and framework.is_parameter(rec.target)  # assign_value takes it on
        same_dtype = casts or dtype is None or dtypes.known_name(dtype) == rec.dtype.name
        if shape == tuple(rec.shape) and same_dtype:
            return
        got = f"shape {list(shape)}" + (f" of {dtype}" if dtype is not None else "")
    raise PrefetchdError(
        f"{rec.name!r} is managed by prefetchd: {method} must keep its shape and dtype "
        f"({list(rec.shape)}, {rec.dtype}); got {got}. Nothing was changed")
