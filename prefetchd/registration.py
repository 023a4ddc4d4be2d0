"""Handing a planned model's parameters to its daemon, once, at offload().

The layer hooks (prefetchd/hooks.py) call these after the plan was checked and
before any hook is installed:

    drop_compiled_graphs(model)                       # graphs compiled before offload()
    records = register(daemon, model, params, tier, checkpoint)   # id(param) -> daemon record

A name clash is refused before any parameter is registered, so a refusal
leaves the model as it was.
"""
from .backend import framework
from .errors import DoubleRegisterError, PrefetchdError


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
        daemon.register_checkpoint(model, checkpoint=None if checkpoint is True else checkpoint)
        handles = {key: daemon.handle(p.name) for key, p in params.items()}
    else:
        _refuse_taken_names(daemon, params.values())
        handles = {key: daemon.register(p, p.name, tier=tier) for key, p in params.items()}
    return {key: daemon.record(handle) for key, handle in handles.items()}


def _refuse_taken_names(daemon, params):
    """Names are unique in one daemon: a clash is refused before any parameter is
    registered (one found midway left the earlier ones managed, and the model stuck)."""
    taken, seen = set(daemon.names()), set()
    for p in params:
        if p.name in taken or p.name in seen:
            raise DoubleRegisterError(
                f"prefetchd.offload: a tensor named {p.name!r} is already registered (names are unique in "
                f"one daemon: a second model whose parameters have the same names needs its own daemon, "
                f"or a prefix, e.g. model.update_parameters_name('second.')); nothing was registered")
        seen.add(p.name)
