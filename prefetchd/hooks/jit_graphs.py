"""Cells that run inside the graph of a @jit method a construct calls.

`@mindspore.jit def _mlp(self, x): return self.fc2(self.fc1(x))`, called from
a block's construct, runs fc1 and fc2 inside that method's graph, and
MindSpore 2.10 compiles the forward hooks of cells called there into it:
prefetchd's fail to compile ("Unsupported statement 'Import'"), and a hook
that compiled would run once, at trace time, not at every call. The planner
(prefetchd/hooks/planner.py) never makes such cells units or searches them, and the
part probes (prefetchd/hooks/parts.py) skip them; a plan that would still hook one
(`units=` naming it) is refused here.

    compiled_calls(cell) -> [("self._mlp", owner, "_mlp", [("self.fc1", fc1), ...]), ...]

The `@mindspore.jit` methods (other than `construct`) that `cell`'s construct
calls, directly or through plain helper methods, each with the sub-cells its
body uses (called or otherwise). Those sub-cells run inside the method's
graph: MindSpore 2.10 compiles their forward hooks into it (a prefetchd hook
there fails to compile, and would run once at trace time, not at each call),
so none of them, nor any cell under them, may carry a prefetchd hook.
"""
import inspect

from ..analysis.chain_steps import CALL
from ..analysis.source_chains import chains
from ..backend import framework
from ..errors import PrefetchdError
from .construct_reads import MAX_INLINE, is_framework, is_jit, resolve


def cells_in_jit_graphs(model):
    """id(cell) -> (owner name, owner, method name, called expression) for every cell that
    runs inside the graph of a @jit method (not a compiled construct) a construct calls,
    and every cell under it (compiled_calls, below)."""
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


def compiled_calls(cell):
    """(method expression, owner cell, method name, [(expression, sub-cell)]) for each
    @jit method `cell`'s construct calls (through plain helpers too), with the sub-cells
    run inside its graph. A compiled construct itself is not reported (the planner
    treats the whole cell as compiled)."""
    found = {}
    if not is_jit(cell.construct):
        _walk_calls(cell, type(cell).construct, (), "self", found, None, 0, set())
    return [(expr, owner, name, list(cells.values())) for expr, owner, name, cells in found.values()]


def _walk_calls(root, function, prefix, base, found, inside, depth, seen):
    """Follow `function`'s chains from `root` (written `base`); `inside`: the key in `found`
    of the jit method whose graph this body runs in, or None."""
    ms = framework.mindspore()
    key = (function, id(root), inside)
    if key in seen or depth > MAX_INLINE:
        return
    seen.add(key)
    for chain in chains(function) or ():
        for expr, obj, rest in resolve(root, prefix + chain, function):
            expr = base + expr[len("self"):]
            if isinstance(obj, ms.nn.Cell):
                if inside is not None:
                    found[inside][3].setdefault(id(obj), (expr, obj))
            elif rest and rest[0] == CALL and inspect.ismethod(obj) and isinstance(obj.__self__, ms.nn.Cell) \
                    and not is_framework(obj.__func__):
                owner, method = obj.__self__, obj.__func__
                owner_expr = expr[:-len(obj.__name__) - 1]
                if inside is None and is_jit(method):
                    here = (id(owner), method)
                    found.setdefault(here, (expr, owner, obj.__name__, {}))
                    _walk_calls(owner, method, (), owner_expr, found, here, depth + 1, seen)
                else:
                    _walk_calls(owner, method, (), owner_expr, found, inside, depth + 1, seen)
