"""New values for an offloaded model's parameters: `prefetchd.load_param_into_net`.

`mindspore.load_param_into_net(net, params)` reads each parameter's `.data`,
which prefetchd refuses for a weight that is not resident (its home is
unmapped: reading it would kill the process), so on an offloaded model it
stops at the first such weight. This takes the same arguments and returns the
same two lists, and writes each parameter inside `daemon.use([p])`, one at a
time so it fits any budget the model fits. There `set_data` is adopted into
the parameter's replica and marked dirty, so the value is written back to the
parameter's tier before that replica can be dropped (core/binding.py).

Every name, shape and dtype is checked before anything is written: a refused
load changes nothing. A load that fails part-way (a full disk under the
write-backs, a Ctrl-C) leaves old values beside new ones, which no forward may
read as a model: the model then refuses to run (`handle.half_loaded`, a
HalfLoad) until a load that writes every parameter left out completes.
"""
import logging

import numpy as np

from ..errors import IntegrityError, PrefetchdError
from ..guard import is_managed
from ..staging import load_markers

log = logging.getLogger("prefetchd.hooks")


# A weight is written in place, so its stored value is read first: a damaged one (an
# IntegrityError) fails every load again, and only a new store helps.
DAMAGED = ("a weight's stored value is damaged and a load writes over it in place, so no load can pass "
           "it: close the daemon, stage the checkpoint again (`prefetchd stage CKPT --store DIR`) and "
           "offload with checkpoint=True")


def load_param_into_net(net, parameter_dict, strict_load=False):
    """Load `parameter_dict` (name -> Parameter, Tensor or numpy array, e.g. from
    mindspore.load_checkpoint) into `net`. Returns (param_not_load, ckpt_not_load): the
    net's parameters the dict had no value for, and the dict's names the net has no
    parameter of. Names must match exactly; strict_load=True refuses the load if either
    list would be non-empty. A net that is not offloaded is loaded by MindSpore's own."""
    from ..backend.framework import mindspore
    ms = mindspore()
    handle = getattr(net, "_prefetchd", None)
    if handle is None:
        return ms.load_param_into_net(net, parameter_dict, strict_load=strict_load)
    if handle.closed:
        raise PrefetchdError("prefetchd.load_param_into_net refused: this model's offload was closed "
                             "(handle.close()), so it no longer runs; nothing loaded")
    if not isinstance(parameter_dict, dict):
        raise TypeError(f"parameter_dict must be a dict of name -> Parameter/Tensor/array, "
                        f"not {type(parameter_dict).__name__}")
    params = {p.name: p for p in net.get_parameters()}
    not_loaded = [name for name in params if name not in parameter_dict]
    unused = [name for name in parameter_dict if name not in params]
    if strict_load and (not_loaded or unused):
        missing = [f"{_names(not_loaded)} of the net's parameters have no value in the dict"] if not_loaded else []
        extra = [f"{_names(unused)} of the dict's names are no parameter of the net"] if unused else []
        raise PrefetchdError(f"prefetchd.load_param_into_net(strict_load=True) refused, nothing loaded: "
                             f"{'; '.join(missing + extra)}")
    todo = [(params[name], value) for name, value in parameter_dict.items() if name in params]
    converted = set()
    for param, value in todo:
        if _check(param, value, strict_load):
            converted.add(param.name)
        if is_managed(value):
            # Its data may be refused mid-load (not resident), leaving the net half-loaded.
            raise PrefetchdError(f"prefetchd.load_param_into_net refused, nothing loaded: the value for "
                                 f"{param.name!r} is itself managed by prefetchd; load from a checkpoint "
                                 f"(mindspore.load_checkpoint) or from arrays")
    store = handle.daemon.config.store_dir
    with handle.between_passes():     # a forward on another thread never reads a half-written weight
        written, writing = [], False       # (writing: a write may have begun, e.g. Ctrl-C right after it)
        if todo:                           # a crash from here on leaves the store mixed: say so in it
            load_markers.begin(store, list(params), {p.name for p, _ in todo}
                               | (handle.half_loaded.pending if handle.half_loaded else set()))
        try:
            for param, value in todo:
                array = _array(value)
                with handle.daemon.use([param]):
                    writing = True
                    # np.require keeps a 0-d value 0-d (np.ascontiguousarray makes it 1-d)
                    dtype = param.dtype if param.name in converted else None
                    param.set_data(ms.Tensor(np.require(array, requirements="C"), dtype=dtype))
                    written.append(param.name)
        except BaseException as e:
            if isinstance(e, IntegrityError) and not writing:
                e.add_note(f"prefetchd: nothing was loaded; {DAMAGED}")
            if writing or handle.half_loaded:     # (writing: set before any write, so also after one)
                earlier = handle.half_loaded
                handle.half_loaded = HalfLoad(handle, net, written, [p.name for p, _ in todo[len(written):]],
                                              e, earlier)
                if earlier is not None:
                    earlier.remove()
                e.add_note(str(handle.half_loaded))
            raise
        if handle.half_loaded and handle.half_loaded.pending <= set(written):
            handle.half_loaded.remove()
            handle.half_loaded = None
        if todo and handle.half_loaded is None:      # complete: durable once written back
            try:
                handle.daemon.flush([p for p, _ in todo]).result()
            except BaseException as e:
                e.add_note("prefetchd: the load is in the model, but not all of it is in the store yet: "
                           "daemon.flush() once the store is fixed; a process that ends before leaves the "
                           "store marked half-loaded")
                raise
            load_markers.finish(store, list(params))
    return not_loaded, unused


def after_crash(handle, net, checkpoint):
    """`handle.half_loaded` for a model just offloaded: a HalfLoad when its weights come from
    a store (checkpoint=True) holding the marker of a load into it that did not finish
    (prefetchd.staging.load_markers); else None (weights written whole, from the model's
    values or a checkpoint file, clear a marker left)."""
    store, names = handle.daemon.config.store_dir, [p.name for p in net.get_parameters()]
    if checkpoint is not True:
        load_markers.finish(store, names)
        return None
    pending = load_markers.left_by_a_crash(store, names)
    return HalfLoad(handle, net, [], pending, None, crashed=store) if pending else None


class HalfLoad:
    """A load into an offloaded model that stopped part-way: `pending`, the names of the
    parameters it did not write (with those an earlier one left, not written since); str()
    is the refusal. The model's own pass refuses to begin (hooks/pass_boundaries.py); each of its
    cells gets a pre-hook refusing a call of it alone (a unit, a cell inside one, a root
    cell) until remove(), or the handle is closed."""

    def __init__(self, handle, net, written, left, error, earlier=None, crashed=None):
        """crashed: the store directory whose marker says a load's process ended during it
        (then error is None)."""
        self.pending = set(left) | (earlier.pending - set(written) if earlier else set())
        if crashed is not None:
            self.message = (f"prefetchd: a load_param_into_net into this {type(net).__name__} did not finish "
                            f"before its process ended (a marker in {crashed} says so), so the store may "
                            f"hold old values beside new ones: the model refuses to run until a "
                            f"prefetchd.load_param_into_net that writes the {_names(sorted(self.pending))} "
                            f"parameters it was loading completes (or the checkpoint is staged again)")
        else:
            cause = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
            remedy = (DAMAGED if isinstance(error, IntegrityError)
                      else "run the same load again once its cause is fixed")
            self.message = (f"prefetchd: a load_param_into_net into this {type(net).__name__} stopped after "
                            f"{len(written)} of {len(written) + len(left)} parameters ({cause[:300]}), so "
                            f"the model holds old values beside new ones: it refuses to run until a "
                            f"load_param_into_net that writes the {_names(sorted(self.pending))} parameters "
                            f"not loaded completes ({remedy})")
        self._handle = handle
        self._hooks = [cell.register_forward_pre_hook(self._refuse, prepend=True)    # before its pins
                       for _, cell in net.cells_and_names() if cell is not net]

    def _refuse(self, cell, inputs):
        if not self._handle.closed:
            raise PrefetchdError(self.message)

    def remove(self):
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def __str__(self):
        return self.message


def _names(names):
    if not names:
        return "none"
    shown = ", ".join(repr(n) for n in names[:3])
    return f"{len(names)} ({shown}{', ...' if len(names) > 3 else ''})"


def _meta(value):
    """(shape, dtype name) of a Parameter, Tensor or array, without reading its data."""
    from ..dtypes import name_of
    try:
        return tuple(value.shape), name_of(value.dtype)
    except (AttributeError, TypeError, KeyError, ValueError):
        raise TypeError(f"a value of type {type(value).__name__} is not a Parameter, Tensor or numpy "
                        f"array") from None


# The dtypes MindSpore's load_param_into_net converts between (strict_load=False): a float to
# another float, an int to another int (mindspore.train.serialization._type_convert, 2.10).
_CONVERTIBLE = ({"float16", "float32", "float64", "bfloat16"}, {"int8", "int16", "int32", "int64"})


def _check(param, value, strict_load):
    """Refuse a value of another shape, or of a dtype MindSpore's own load would not convert
    to the parameter's; True if it is converted (logged, as MindSpore does)."""
    shape, dtype = _meta(value)
    want_shape, want_dtype = _meta(param)
    convertible = not strict_load and any({dtype, want_dtype} <= kinds for kinds in _CONVERTIBLE)
    if shape != want_shape or (dtype != want_dtype and not convertible):
        raise PrefetchdError(f"prefetchd.load_param_into_net refused, nothing loaded: {param.name!r} is "
                             f"{want_shape} {want_dtype}, the value given is {shape} {dtype}")
    if dtype != want_dtype:
        log.warning("prefetchd.load_param_into_net: the value for %r is %s, converted to the parameter's "
                    "%s (as mindspore.load_param_into_net does)", param.name, dtype, want_dtype)
    return dtype != want_dtype


def _array(value):
    return value if isinstance(value, np.ndarray) else value.asnumpy()
