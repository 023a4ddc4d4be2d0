"""Cells that run inside the graph of a @jit method a construct calls.

`@mindspore.jit def _mlp(self, x): return self.fc2(self.fc1(x))`, called from
a block's construct, runs fc1 and fc2 inside that method's graph, and
MindSpore 2.10 compiles the forward hooks of cells called there into it:
prefetchd's fail to compile ("Unsupported statement 'Import'"), and a hook
that compiled would run once, at trace time, not at every call. The planner
(prefetchd/hooks/planner.py) never makes such cells units or searches them, and the
part probes (prefetchd/hooks/parts.py) skip them; a plan that would still hook one
(`units=` naming it) is refused here.
"""
from .construct_reads import compiled_calls, is_jit
from ..errors import PrefetchdError


def cells_in_jit_graphs(model):
    """id(cell) -> (owner name, owner, method name, called expression) for every cell that
    runs inside the graph of a @jit method (not a compiled construct) a construct calls,
    and every cell under it (prefetchd/construct_reads.compiled_calls)."""
    names = {}
    for name, cell in model.cells_and_names():
        names.setdefault(id(cell), name)
    found = {}
    for name, cell in model.cells_and_names():
        if is_jit(cell.construct):
            continue
        for _, owner, method, used in compiled_calls(cell):
            owner_name = names.get(id(owner), name)
            for expr, sub in used:
                for _, inner in sub.cells_and_names():
                    if inner is not owner:
                        found.setdefault(id(inner), (owner_name, owner, method, expr))
    return found


def refuse_units_in_jit_graphs(model, plan, jit):
    """PrefetchdError if a unit's cell of `plan` runs inside a @jit method's graph (`jit`:
    cells_in_jit_graphs). Parts need no check: part_cells never probes those cells."""
    if not jit or not plan.units:
        return
    names = {}
    for name, cell in model.cells_and_names():
        names.setdefault(id(cell), name)
    for unit in plan.units:
        for _, cell in unit.cells:
            if id(cell) not in jit:
                continue
            owner_name, owner, method, expr = jit[id(cell)]
            kind = type(owner).__name__
            where = repr(owner_name) if owner_name else "the model"
            raise PrefetchdError(
                f"prefetchd.offload: {where} ({kind}) calls {expr} from its @jit method {method!r}; "
                f"MindSpore compiles the forward hooks of cells called inside a jit graph into that graph, "
                f"where prefetchd's hooks cannot run, and {names.get(id(cell), type(cell).__name__)!r} would "
                f"carry one (it is a cell of unit {unit.name!r}). Decorate {kind}.construct with "
                f"@mindspore.jit instead of {method!r} (a compiled cell streams whole, as one unit), drop @jit "
                f"from {method!r}, or pass units= naming cells that neither contain {where} nor are called "
                f"from {method!r} (cells left out of every unit are pinned in the root)")
