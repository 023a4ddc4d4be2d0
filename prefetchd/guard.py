"""Class-swap guards on framework tensors prefetchd manages.

MindSpore tensors are Python objects whose class may be reassigned, so
prefetchd swaps in a subclass to (a) notice in-place writes through the
Python API (marking the tensor dirty so it is written back, never silently
lost) and (b) turn Python-level use of a tensor whose device replica is gone
into a NotResidentError instead of reading someone else's bytes. Kernels that
receive the tensor inside C++ (e.g. a Cell's construct) do not go through
these methods; there the layer hooks check residency before compute.

A guarded tensor also refuses every MindSpore op it is an argument of
(`ops.norm(p)`, `ops.assign(p, v)`, `p * 2`, `p.abs()`, a Primitive call):
MindSpore 2.10's PyNative dispatch calls `__fallback__(op, args...)` on a tensor
argument whose class defines it instead of running the kernel, so the op is
refused before native code touches the unmapped memory (which would kill the
process with SIGSEGV). The tracking class, which a tensor has while compute may
use it, does not define it: the forward's ops never pay for a Python call.
Not every entry point dispatches that way: those that do not (a tensor inside a sequence
argument of a Primitive, `mindspore.Tensor(p)`, a base class's reading method called
directly) are checked by wrapping MindSpore's functions in front of them
(`_cover_entry_points`); docs/daemon-api.md ("Reading
weights outside a forward") lists what is covered and what is not.
"""
import sys

import numpy as np

from .errors import DaemonClosedError, NotResidentError, UseAfterFreeError
_tracked = {}   # base class -> tracking subclass
_guarded = {}   # base class -> guarding subclass
_guarding_types = set()   # _guarded's values, for a membership test on MindSpore's paths

_MUTATORS = ("__setitem__", "copy_", "assign_value", "set_data", "fill_", "zero_", "set_dtype")
# Mutators that may change the tensor's shape or dtype: checked before they run, since a
# refusal after MindSpore had applied one left the tensor reshaped outside the daemon's memory.
_RELAYOUTS = ("assign_value", "set_data", "set_dtype")
# MindSpore 2.10 on CPU hands out numpy arrays that are views of the tensor's memory: for a
# managed tensor that is its home, unmapped once it is evicted, so an array kept from inside
# `daemon.use` (or a forward) would kill the process when read later. They return copies.
_VIEWERS = ("asnumpy", "numpy", "__array__")
# Reads and writes of a tensor whose device replica is gone: all refused, so
# nothing is read from, or written into, memory that belongs to another tensor.
_READERS = ("asnumpy", "numpy", "__array__", "__getitem__", "item", "tolist", "__add__", "__radd__",
            "__sub__", "__rsub__", "__mul__", "__rmul__", "__matmul__", "__rmatmul__", "__truediv__",
            "__neg__", "__abs__", "sum", "mean", "copy_", "__setitem__", "asnumpy_of_slice_persistent_data",
            "set_data", "assign_value", "fill_", "zero_", "set_dtype",
            # Copies read every byte (an optimizer's constructor clones each parameter).
            "clone", "copy", "__copy__", "__deepcopy__",
            # Hand the storage to native code without an op: pickling (Parameter.__reduce_ex__
            # wraps it in a Tensor), checkpoint writers (save_checkpoint reads `param.data`,
            # then `get_bytes`), moves and conversions.
            "__reduce_ex__", "__reduce__", "get_bytes", "move_to", "to", "offload", "_offload", "storage",
            "untyped_storage", "assign_value_cpp", "_update_tensor_data", "__bool__", "__float__", "__int__",
            "__index__")
# Properties read on the way to native code: `p.data` is a second framework tensor over the
# same memory, which nothing guards (mindspore.save_checkpoint(net) reads every parameter that
# way); a @jit function reads `const_arg` of each Tensor argument before its graph runs on it.
_STORAGE_PROPERTIES = {"data": ".data (a second tensor over its memory)", "const_arg": "a @jit call with it as an argument"}
_USE_HINT = ("outside an offloaded model's forward, use managed weights inside `with daemon.use([...])`, "
             "which keeps them resident until the block ends")
_MISSED_READ_HINT = (
    "the read is inside the offloaded model's forward, where offload() did not see it: its planner follows "
    "a construct's attribute reads (self.blocks[3].w1, getattr; docs/offload.md, \"The plan\") and "
    "those of the forward hooks registered before offload(), not a hook registered after it, nor "
    "reads through cells_and_names(), name_cells(), a module-level object or a weakref. Read "
    "the weight through its cell's attributes there (a hook: register it before offload()), or "
    "leave the cell that owns it out of units= (its weights then stay in the root, pinned for "
    "the whole forward)")
_LOAD_HINT = ("load new values with prefetchd.load_param_into_net (gradients and training through an "
              "offloaded model are not supported)")


def base_class(obj):
    cls = type(obj)
    while getattr(cls, "_prefetchd_wrapper", False):
        cls = cls.__mro__[1]
    return cls


def _tracking_class(base):
    cls = _tracked.get(base)
    if cls is None:
        def make(name):
            original = getattr(base, name)

            def method(self, *args, **kwargs):
                state = self.__dict__
                if state.get("_prefetchd_in_write"):   # set_data calls assign_value: report once
                    return original(self, *args, **kwargs)
                check = state.get("_prefetchd_check_write") if name in _RELAYOUTS else None
                if check is not None:
                    check(name, args, kwargs)            # refused before anything changes
                state["_prefetchd_in_write"] = True
                try:
                    result = original(self, *args, **kwargs)
                finally:
                    state["_prefetchd_in_write"] = False
                hook = state.get("_prefetchd_on_write")
                if hook is not None:
                    hook(name)
                return result
            method.__name__ = name
            return method
        def copying(name):
            original = getattr(base, name)

            def method(self, *args, **kwargs):
                return np.array(original(self, *args, **kwargs), copy=True)
            method.__name__ = name
            return method
        ns = {name: make(name) for name in _MUTATORS if hasattr(base, name)}
        ns.update({name: copying(name) for name in _VIEWERS if hasattr(base, name)})
        ns["_prefetchd_wrapper"] = True
        cls = _tracked[base] = type(base.__name__, (base,), ns)
    return cls


def refusal(target, what):
    """The error a guarded tensor raises when `what` (a method, an op) is tried on it."""
    error = target.__dict__["_prefetchd_error"]()
    if not isinstance(error, NotResidentError):
        return error
    message = f"refused {what}: {error}"
    if isinstance(error, (UseAfterFreeError, DaemonClosedError)):
        pass                                  # no daemon to ask: freed by ops.free(), or closed
    elif _inside_an_offloaded_forward():
        # "use daemon.use outside a forward" misled here: the planner missed this read.
        message = (f"refused {what}: tensor {error.name!r} is not pinned for this read (state: "
                   f"{error.state}); {_MISSED_READ_HINT}")
    elif "daemon.use" in message:
        message += f"; {_LOAD_HINT}"
    else:
        message += f"; {_USE_HINT}, and {_LOAD_HINT}"
    return type(error)(error.name, error.tier, error.state, message)


def _inside_an_offloaded_forward():
    """Whether the calling thread is inside the call of an offloaded model (the cell
    offload() marked; refusals only: it walks the stack)."""
    from mindspore.nn import Cell
    code = Cell.__call__.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and "_prefetchd" in getattr(frame.f_locals.get("self"), "__dict__", {}):
            return True
        frame = frame.f_back
    return False


def _op_name(op):
    name = getattr(op, "name", None)
    return name if isinstance(name, str) and name else type(op).__name__


def _guarding_class(base):
    cls = _guarded.get(base)
    if cls is None:
        def make(name):
            def method(self, *args, **kwargs):
                raise refusal(self, f"{name}()")
            method.__name__ = name
            return method

        def storage(what):
            def refuse(self, *value):
                raise refusal(self, what)
            return property(refuse, refuse)

        def fallback(self, op, *args, **kwargs):
            # MindSpore's dispatch, for an op taking this tensor (see the module docstring).
            raise refusal(self, f"MindSpore op {_op_name(op)}")
        ns = {name: make(name) for name in _READERS if hasattr(base, name)}
        ns.update({name: storage(what) for name, what in _STORAGE_PROPERTIES.items() if hasattr(base, name)})
        ns["__fallback__"] = fallback
        ns["_prefetchd_wrapper"] = True
        ns["__repr__"] = lambda self: f"<prefetchd tensor {self.__dict__.get('_prefetchd_name')!r}: not resident>"
        ns["__str__"] = ns["__repr__"]
        cls = _guarded[base] = type(base.__name__, (base,), ns)
        _guarding_types.add(cls)
    return cls


def _refuse_guarded_items(args, what, depth=3):
    """Refuse a guarded tensor inside a sequence argument (subclasses too: a namedtuple),
    nested up to `depth` levels."""
    for arg in args:
        if isinstance(arg, (tuple, list)):
            for item in arg:
                if type(item) in _guarding_types:
                    raise refusal(item, what)
                if depth > 1 and isinstance(item, (tuple, list)):
                    _refuse_guarded_items((item,), what, depth - 1)


def _cover_entry_points():
    """Wrap the two MindSpore 2.10 paths to native code that skip `__fallback__`: a
    legacy Primitive's call (`ops.stack((p, p))`, `ops.addn`), whose dispatch checks only
    arguments that are tensors themselves, and `mindspore.Tensor(p)`, a second tensor over
    p's memory that no guard sees. Once per process; a tensor no daemon guards passes on."""
    primitive = sys.modules.get("mindspore.ops.primitive")
    run_op = getattr(primitive, "_run_op", None)
    if run_op is not None and not getattr(run_op, "_prefetchd_wrapper", False):
        def checked_run_op(obj, op_name, args):
            _refuse_guarded_items(args, f"MindSpore op {op_name}")
            return run_op(obj, op_name, args)
        checked_run_op._prefetchd_wrapper = True
        # array_ops, math_ops, ... imported the function by name: each module's binding.
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("mindspore.") \
                    and getattr(module, "_run_op", None) is run_op:
                module._run_op = checked_run_op
    _cover_native_readers()
    tensor_module = sys.modules.get("mindspore.common.tensor")
    init = getattr(tensor_module, "_init", None)
    if init is not None and not getattr(init, "_prefetchd_wrapper", False):
        def checked_init(input_data=None, *args, **kwargs):   # Tensor.__init__ calls it by name
            if type(input_data) in _guarding_types:
                raise refusal(input_data, "mindspore.Tensor(...) of it (a second tensor over its memory)")
            return init(input_data, *args, **kwargs)
        checked_init._prefetchd_wrapper = True
        tensor_module._init = checked_init


# The native methods that read a tensor's memory with no op in between: a guarding subclass
# overrides the Python ones in front of them, but a base class's called directly
# (`mindspore.Tensor.asnumpy(p)`, `mindspore.Parameter.asnumpy(p)`) reached them past it.
_NATIVE_READERS = ("asnumpy", "get_bytes", "_item", "_tolist", "_numpy_non_blocking", "to_dlpack",
                   "__getitem__", "__setitem__")


def _cover_native_readers():
    """Wrap those methods on MindSpore's native tensor class (every tensor's base) to refuse a
    guarded tensor; about 0.4 us more per call on any tensor (asnumpy: 6.0 -> 6.4 us)."""
    try:
        from mindspore._c_expression import TensorPy
    except ImportError:
        return
    for name in _NATIVE_READERS:
        native = TensorPy.__dict__.get(name)
        if native is None or getattr(native, "_prefetchd_wrapper", False):
            continue

        def checked(self, *args, _native=native, _name=name, **kwargs):
            if type(self) in _guarding_types:
                raise refusal(self, f"{_name}() of MindSpore's tensor class called directly")
            return _native(self, *args, **kwargs)
        checked._prefetchd_wrapper = True
        setattr(TensorPy, name, checked)


def track(target, name, on_write, check_write=None):
    """Report in-place writes through the Python API by calling on_write(method_name);
    check_write(method_name, args, kwargs) runs before a write that may change the layout."""
    target.__dict__["_prefetchd_on_write"] = on_write
    target.__dict__["_prefetchd_check_write"] = check_write
    target.__dict__["_prefetchd_name"] = name
    target.__class__ = _tracking_class(base_class(target))


def guard(target, error_factory, name=None):
    """Make Python-level reads of target raise error_factory() until track() or release()."""
    target.__dict__["_prefetchd_error"] = error_factory
    if name is not None:
        target.__dict__["_prefetchd_name"] = name
    if not _guarded:
        _cover_entry_points()
    target.__class__ = _guarding_class(base_class(target))


def is_guarded(target):
    return type(target) in _guarding_types


def is_managed(target):
    """True while a daemon manages target (its class is one of ours)."""
    return bool(getattr(type(target), "_prefetchd_wrapper", False))


def release(target):
    """Give the object back its own class."""
    target.__class__ = base_class(target)
    for key in ("_prefetchd_on_write", "_prefetchd_check_write", "_prefetchd_error", "_prefetchd_name",
                "_prefetchd_in_write"):
        target.__dict__.pop(key, None)
