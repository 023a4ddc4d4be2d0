"""What offload() refuses, and what an offloaded model refuses to do, with their messages.

The layer hooks (prefetchd/hooks/offload.py) call these: `refuse_managed` and
`lookahead_count` when offload() starts, before anything is registered;
`backward_refused` from the model's backward pre-hook (prefetchd/hooks/backward.py), and `closed_refused`
from the pre-hook a closed handle leaves on the model (the hooks raise what
these return). Messages are part of the contract: tests match them.
"""
import logging
import operator

from ..core.records import NOT_COPYABLE
from ..errors import PrefetchdError
from ..guard import is_managed

log = logging.getLogger("prefetchd.hooks")


def refuse_managed(model):
    """A model (or a parameter of it) already streamed by a daemon cannot be offloaded again:
    its weights no longer sit in ordinary memory, and two daemons would each move them.
    What is not a Cell at all (`mindspore.jit(model)` is a function) is refused as such."""
    from ..backend.framework import mindspore
    if not isinstance(model, mindspore().nn.Cell):
        raise TypeError(f"prefetchd.offload takes a mindspore.nn.Cell, not {type(model).__name__}"
                        + (" (mindspore.jit(model) returns a function: offload the model; a block "
                           "whose construct is @jit-compiled streams whole)" if callable(model) else ""))
    previous = model.__dict__.get("_prefetchd")
    if previous is not None:
        state = ("whose handle was closed" if previous.closed else
                 "which is closed; its weights are in that daemon's store, not in the model"
                 if previous.daemon.closed else "still in use")
        raise PrefetchdError(
            f"prefetchd.offload: this {type(model).__name__} is already offloaded to daemon "
            f"{previous.daemon.config.name!r} ({state}); a model streams through one daemon, once")
    managed = next((p for p in model.get_parameters() if is_managed(p)), None)
    if managed is not None:
        raise PrefetchdError(
            f"prefetchd.offload: parameter {managed.name!r} is already managed by a prefetchd daemon "
            f"(part of another offloaded model, or registered by hand); a tensor streams through one "
            f"daemon, once")


def lookahead_count(value, config, model):
    """offload()'s lookahead= as a count: None and "auto" start from config.lookahead (the cost
    model replaces it for "auto"); an int >= 0 (numpy's too), else ValueError. Either way at
    most one less than the model's cells that hold parameters: no plan has more units than
    those (what the planner splits down to), so a larger lookahead prefetches nothing more;
    it only made the planner split every block to its leaves while the handle reported the
    number asked for. Lowering one the user asked for is logged."""
    asked = value not in (None, "auto")
    if not asked:
        count = config.lookahead
    else:
        try:
            count = operator.index(value)          # an int, numpy's too; not 2.0 or "2"
        except TypeError:
            count = -1
        if isinstance(value, bool) or count < 0:
            raise ValueError(f'prefetchd.offload: lookahead must be an int >= 0 or "auto", got {value!r}')
    holders = sum(1 for _, cell in model.cells_and_names() if next(iter(cell.get_parameters(expand=False)), None)
                  is not None)
    usable = max(0, holders - 1)
    if count > usable and asked:
        log.warning("prefetchd.offload: lookahead %d is more than this model can use (%d cells hold "
                    "parameters, so at most %d units come after the one computing); using %d",
                    count, holders, usable, usable)
    return min(count, usable)


def backward_refused(model_name, unseen=None):
    """A backward pass would read weights released after their forward: unmapped pages, the
    process would die. Raised before the first backward kernel; MindSpore raises it from
    grad()/value_and_grad() and recovers (a plain forward afterwards runs as before).
    unseen: what returned no Tensor the refusal could see, when it is raised in the forward."""
    where = "" if unseen is None else (
        f" ({unseen} returned no Tensor prefetchd could watch for a gradient, so this forward, "
        f"recorded for one, is refused; under ops.stop_gradient, run the model outside the "
        f"gradient's function)")
    return PrefetchdError(
        f"prefetchd: gradients through an offloaded model are not supported: this "
        f"{model_name}'s units are released as soon as their forward ran, and the "
        f"backward pass would read their weights after that{where}. Compute gradients on a model "
        f"that is not offloaded (prefetchd streams weights for inference)")


def refuse_closed(model, daemon_name, cell, inputs):
    """The forward pre-hook of a model whose handle was closed."""
    raise closed_refused(model, daemon_name)


def closed_refused(model, daemon_name):
    """A model whose handle was closed: its weights were given back to the daemon."""
    return PrefetchdError(
        f"prefetchd: this {type(model).__name__} was offloaded to daemon "
        f"{daemon_name!r} and its handle was closed; its weights were given back to that daemon "
        f"(they lived in its tiers, not in ordinary memory), so it cannot run any more (build it "
        f"again, or keep the handle open while the model is used)")


def warn_unlisted_cells(model):
    """Cells with parameters held in a plain list, tuple or dict attribute are not the model's
    cells to MindSpore: their parameters are not listed, so prefetchd cannot manage them and
    they stay in ordinary memory, outside the device budget. Said once per attribute."""
    from ..backend.framework import mindspore
    cell_type = mindspore().nn.Cell
    cells = list(model.cells_and_names())
    listed = {id(c) for _, c in cells}      # (a SequentialCell keeps its children in a list too)
    for name, cell in cells:
        for attr, value in vars(cell).items():
            kind = type(value).__name__
            items = list(value.values()) if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else ()
            held = [c for c in items if isinstance(c, cell_type) and id(c) not in listed
                    and next(iter(c.get_parameters()), None) is not None]
            if held:
                where = f"{name}.{attr}" if name else attr
                log.warning("prefetchd.offload: %r holds %d cells with parameters in a plain %s: MindSpore does "
                            "not list their parameters as the model's, so prefetchd does not manage them (they "
                            "stay in ordinary memory, outside the device budget); use nn.CellList / "
                            "nn.CellDict", where, len(held), kind)


class NotCopyable:
    """An offloaded model's handle (`model._prefetchd`) holds its daemon's memory and hooks:
    `copy.deepcopy(model)` or pickling inside `daemon.use([...])` (outside it, the weights
    refuse) reached it and failed with "cannot pickle 'prefetchd._native.Arena'"."""

    def __deepcopy__(self, memo):
        raise PrefetchdError(_NOT_COPYABLE)

    def __reduce_ex__(self, protocol):
        raise PrefetchdError(_NOT_COPYABLE)


_NOT_COPYABLE = NOT_COPYABLE[0].upper() + NOT_COPYABLE[1:]
