"""Handing a planned model's parameters to its daemon, once, at offload().

The layer hooks (prefetchd/hooks/offload.py) call these after the plan was checked and
before any hook is installed:

    drop_compiled_graphs(model)                       # graphs compiled before offload()
    records = register(daemon, model, params, tier, checkpoint)   # id(param) -> daemon record

A name clash, or host-tier weights the host budget cannot hold, is refused
before any parameter is registered, and a placement that fails part-way (the
store's disk full) undoes the others (Daemon.register_all), so a refusal or a
failure leaves the model as it was.
With checkpoint=..., `register_checkpoint` registers every parameter from the store.
`unregister(daemon, units)` gives it all back when the handle closes; `forget_when_dropped`
when a handle is collected unclosed (its model dropped), at the daemon's next offload().
"""
import collections
import gc
import logging
import weakref

import numpy as np

from .. import dtypes, staging
from ..backend import framework
from ..errors import BudgetError, DoubleRegisterError, PrefetchdError, ShutdownError, UnknownTensorError
from ..core.registry import managing_daemon
from ..cost.model import block_bytes as host_block_bytes

log = logging.getLogger("prefetchd.hooks")


def drop_compiled_graphs(model):
    """Graphs compiled before offload() read the storage they saw then: make them recompile."""
    for name, cell in model.cells_and_names():
        try:
            framework.invalidate_compiled(cell)
        except RuntimeError as e:
            raise PrefetchdError(f"prefetchd.offload: cell {name or type(cell).__name__!r} has "
                                 f"compiled graphs prefetchd cannot invalidate: {e}") from None


def register(daemon, model, params, tier, checkpoint):
    """Register `params` (id(param) -> Parameter) with `daemon` once; id(param) -> daemon record.
    checkpoint: None (the parameters' values), True (the store holds them) or a file to stage."""
    if checkpoint is not None:
        # Weights come from the store (staged now from a file, or already there).
        register_checkpoint(daemon, model, checkpoint=None if checkpoint is True else checkpoint)
        handles = {key: daemon.handle(p.name) for key, p in params.items()}
    else:
        _refuse_taken_names(daemon, model, params.values())
        if tier == "host":
            _refuse_beyond_the_host_budget(daemon, params.values())
        # All or none: a placement that fails (a full disk) leaves every parameter as it was.
        handles = dict(zip(params, daemon.register_all(params.values(), tier=tier)))
    records = {key: daemon.record(handle) for key, handle in handles.items()}
    for rec in records.values():
        # An offloaded model's weight is used only while pinned: its forward, daemon.use,
        # prefetchd.load_param_into_net. A write outside (set_data, ops.assign) was taken
        # while it happened to be resident and refused at the next one not, so
        # mindspore.load_param_into_net or model.apply(init) left a model of neither
        # weights: guarded whenever nothing pins it, resident or not (core/scheduler.py).
        rec.guard_unpinned = True
    return records


def register_checkpoint(daemon, model, *, checkpoint=None):
    """Register every parameter of `model` with `daemon` from its store: the remote replica
    is the data. Returns their handles.

    checkpoint: a .ckpt/.safetensors file to stage into the daemon's store first (tensor
    by tensor); None if the store already holds the tensors (e.g. `prefetchd stage`). The
    model may be built with `no_init_parameters`: its weights never need to exist in RAM.
    """
    daemon.check_open()
    backend = daemon.backend
    params = list(model.get_parameters())
    # Nothing reaches the live store before the file is known to fit the model: a name
    # another model of this daemon streams would be overwritten under it, and a file
    # that does not fit would replace good tensors and then be refused.
    _refuse_taken_names(daemon, model, params)
    if checkpoint is not None:
        _check_file(params, checkpoint)
        staging.stage_tensors(backend.store, staging.iter_checkpoint(checkpoint))
    # Every parameter is checked before any is bound: binding one to its home drops
    # its own values, so a bad entry found half-way would leave the model unusable.
    entries = []
    for p in params:
        if not backend.store_contains(p.name):
            raise UnknownTensorError(f"the store has no tensor for parameter {p.name!r}" + _quarantined(backend))
        shape, dtype = staging.read_meta(backend.store_info(p.name))
        _check_layout(p, shape, np.dtype(dtype).name, "the store")
        entries.append((p, shape, dtype))
    return [daemon.register_remote(p.name, shape, dtype, target=p) for p, shape, dtype in entries]


def _quarantined(backend):
    """What the store's recovery set aside when it opened (a truncated or damaged file), for
    a message about a tensor it lacks: else only a WARNING said so, at open."""
    found = list(getattr(getattr(backend, "store", None), "quarantined", None) or ())
    if not found:
        return ""
    first = found[0]
    return (f"; the store set aside {len(found)} unusable file(s) when it opened, e.g. {first['path']} "
            f"({first['reason']}): a damaged tensor file is never served; stage the checkpoint again")


def _check_file(params, checkpoint):
    """The file holds every parameter in the model's shape and dtype (a file missing one
    would leave an older stage's tensor in use), and its checksum, if it has one, matches:
    read once, writing nothing (a mapped file: the data pages are touched only to check
    a checksum)."""
    reader = staging.iter_checkpoint(checkpoint)
    try:
        held = {name: (tuple(shape), dtypes.name_of(dtype)) for name, shape, dtype, _ in reader}
    finally:
        reader.close()
    missing = [p.name for p in params if p.name not in held]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise UnknownTensorError(f"prefetchd.offload: {checkpoint} has no tensor for {len(missing)} "
                                 f"parameter(s) of the model ({shown}); nothing was staged")
    for p in params:
        _check_layout(p, *held[p.name], str(checkpoint))


def unregister(daemon, units):
    """handle.close(): the daemon forgets the units' weights (memory, host blocks, the store
    files it wrote for them; a staged store keeps its files), so a long-lived daemon does
    not grow with every model it streamed. False where that is refused (a daemon.use() block
    pins one now): they stay registered, said once in a WARNING, until a later close() or
    the daemon's. True once they are gone (or the daemon is)."""
    records = _live(_records(units))
    refused = _unregister(daemon, records)
    if refused is not None:
        log.warning("prefetchd: the closed model's %d weights stay in daemon %r until it closes, or "
                    "handle.close() is called again: %s", len(records), daemon.config.name, refused)
    return refused is None


def _records(units):
    """The daemon records of `units`' weights, each once (units may share a weight)."""
    return list({id(r): r for u in units for r in u.records}.values())


def _live(records):
    """Those not forgotten yet (index None): a close() interrupted after the scheduler had
    unregistered them (Ctrl-C in the wait) failed every later close() with "not
    registered", and said the weights stayed."""
    return [r for r in records if r.index is not None]


def _unregister(daemon, records):
    """daemon.unregister(records): None once they are gone (or the daemon is), else the
    refusal (a daemon.use() block pins one now)."""
    if not records or daemon.closed:
        return None
    try:
        daemon.unregister(records)
    except ShutdownError:      # the daemon closed meanwhile: its tiers went with it
        return None
    except PrefetchdError as e:
        return e
    return None


# Per daemon: the records of its models dropped unclosed, given back at its next offload().
# A weakref finalizer only appends to the deque (safe wherever the gc runs it); the
# unregistering happens on the thread that calls offload().
_dropped = weakref.WeakKeyDictionary()


def forget_when_dropped(handle, units):
    """When `handle` is collected unclosed (the user dropped the model, as a loop that
    builds and offloads a model each round does), its daemon's next offload() gives the
    `units`' weights back, as handle.close() would have. Returns the finalizer: close()
    detaches it. It keeps the records only: units refer to the model's cells."""
    queue = _dropped.setdefault(handle.daemon, collections.deque())
    return weakref.finalize(handle, queue.append, _records(units))


def _give_back_dropped(daemon, collect=False):
    """Unregister the weights of `daemon`'s models dropped unclosed; True if any were.
    collect: run the gc first (a dropped model and its handle refer to each other, so
    they wait for a gc pass; a name clash with them is worth one)."""
    queue = _dropped.get(daemon)
    if queue is None:
        return False
    if collect:
        gc.collect()
    gave = False
    while queue:
        records = _live(queue.popleft())
        if not records:
            continue
        refused = _unregister(daemon, records)
        if refused is not None:           # at a later offload()
            queue.append(records)
            log.warning("prefetchd: a dropped model's %d weights stay in daemon %r for now: %s",
                        len(records), daemon.config.name, refused)
            break
        gave = True
    return gave


def _check_layout(p, shape, dtype_name, where):
    if tuple(shape) != tuple(p.shape):
        raise ValueError(f"{p.name!r}: {where} holds shape {tuple(shape)}, the model expects {tuple(p.shape)}")
    # By name (str(mindspore.float32) is "Float32"): mindspore.dtype_to_nptype is
    # deprecated and warns on every call.
    want = dtypes.MINDSPORE_CKPT.get(str(p.dtype))
    if want != dtype_name:
        raise ValueError(f"{p.name!r}: {where} holds {dtype_name}, the model expects {want or p.dtype} "
                         f"(convert the checkpoint, or build the model in that dtype)")


def _refuse_taken_names(daemon, model, params):
    """Names are unique in one daemon: a clash is refused before any parameter is
    registered (one found midway left the earlier ones managed, and the model stuck).
    Models dropped unclosed give theirs back first."""
    params = list(params)
    _give_back_dropped(daemon)
    taken = set(daemon.names())
    if any(p.name in taken for p in params) and _give_back_dropped(daemon, collect=True):
        taken = set(daemon.names())
    seen = {}
    for p in params:
        if p.name in seen:
            raise DoubleRegisterError(
                f"prefetchd.offload: two of this model's parameters are named {p.name!r}"
                f"{_paths_of(model, seen[p.name], p)} (names are unique in one daemon; MindSpore renames a "
                f"parameter when a CellList holding it is sliced or extended, as `self.layers[:n]` in a "
                f"construct does, or when its cell is set as an attribute again, as "
                f"`self.classifier = self.classifier.to_float(...)` does, which names the weight "
                f"'classifier.weight'): give them their paths as names first, `for path, p in "
                f"model.parameters_and_names(): p.name = path`; nothing was registered")
        if p.name in taken:
            raise DoubleRegisterError(
                f"prefetchd.offload: a tensor named {p.name!r} is already registered (names are unique in "
                f"one daemon: close the handle of the model that has it, or give a second model of the "
                f"same names its own daemon or a prefix, e.g. model.update_parameters_name('second.'); "
                f"a loop whose `handle = prefetchd.offload(...)` still holds the last round's handle "
                f"keeps that model: handle.close() or `del handle` first); nothing was registered")
        seen[p.name] = p
        owner = managing_daemon(p)
        if owner is not None:
            raise DoubleRegisterError(
                f"prefetchd.offload: parameter {p.name!r} is managed by prefetchd daemon {owner!r} (a "
                f"model, or a Parameter it shares, is offloaded to one daemon at a time: close that "
                f"handle first); nothing was registered")


def _paths_of(model, *params):
    """', at 'a.0.weight' and 'b.0.weight'': where in `model` the parameters are, or ''."""
    paths = {}
    for path, p in model.parameters_and_names():
        paths.setdefault(id(p), path)
    found = [paths[id(p)] for p in params if id(p) in paths]
    return f", at {' and '.join(map(repr, found))}" if len(found) == len(params) else ""


def _refuse_beyond_the_host_budget(daemon, params):
    """Host-tier weights live in the host pool for good: a model it cannot hold is refused whole
    (staging them one by one stopped at the first that did not fit, the earlier ones managed
    and the model stuck). Cached replicas of the remote tier count as free: they are dropped
    for room. Models dropped unclosed give theirs back first (the gc runs if that helps)."""
    need = sum(host_block_bytes(p.nbytes) for p in params)

    def free():
        host = daemon.status()["host"]
        return host["budget"] - host["used"] + host["cached_bytes"], host["budget"]
    room, budget = free()
    if need > room and _give_back_dropped(daemon, collect=True):
        room, budget = free()
    if need > room:
        raise BudgetError(
            f"prefetchd.offload(tier='host'): the model's {len(params)} parameters need {need} bytes of host "
            f"RAM, and the host budget has {room} of {budget} bytes free; raise host_budget, close the "
            f"handles of models you are done with, or keep them on disk with tier='remote' (host RAM then "
            f"caches what fits); nothing was registered")
