"""Whether a plan's units fit under its high watermark: what it needs, and what can never fit.

A plan (prefetchd.hooks.planner.Plan) fits when every tensor, the root unit, each unit beside
the root and, at a lookahead >= 1, each two consecutive units beside the root (the wrap from
the last to the first included) are within the high watermark. `need(plan)` is the largest
of those, the smallest high watermark the plan fits as it is; `problem(plan)` names the
first that is above it, as the refusal's text. The planner compares plans by `need` to
report the one closest to fitting: its binding constraint is what a larger budget relieves.
"""
from .construct_reads import direct_reads


def union_bytes(*units):
    """Device bytes of the units' parameters together, each parameter once."""
    seen, total = set(), 0
    for unit in units:
        for p in unit.params:
            if id(p) not in seen:
                seen.add(id(p))
                total += unit.size(p)
    return total


def need(plan):
    """The smallest high watermark under which `plan` fits (problem(plan) is None there)."""
    root, units = plan.root, plan.units
    needs = [max((u.size(p) for u in [root, *units] for p in u.params), default=0), root.nbytes]
    needs += [union_bytes(root, unit) for unit in units]
    needs += [union_bytes(root, a, b) for a, b in _neighbours(plan)]
    return max(needs)


def problem(plan):
    """What can never fit under `plan`'s high watermark (a message), or None."""
    high, root = plan.high_watermark, plan.root
    for unit in [root, *plan.units]:
        for p in unit.params:
            if unit.size(p) > high:
                return (f"tensor {p.name!r} needs {unit.size(p)} bytes on the device tier; the high "
                        f"watermark is {high} bytes: it can never be resident")
    if root.nbytes > high and plan.compiled_model:
        return (f"the model's construct is compiled (@jit): its cells run inside one graph where "
                f"MindSpore skips their hooks, so all {root.nbytes} bytes of parameters form the root "
                f"unit, above the high watermark {high}; compile its blocks' constructs instead of the "
                f"model's, or raise device_budget")
    if root.nbytes > high:
        return (f"the root unit (parameters of cells outside every unit, and parameters a construct "
                f"outside their unit reads directly: {_short(root.param_names)}) needs "
                f"{root.nbytes} bytes, above the high watermark {high}; pass units= to stream "
                f"some of those cells, or raise device_budget" + _root_reads(plan.root_reads))
    for unit in plan.units:
        together = union_bytes(root, unit)
        if together > high:
            return (f"unit {unit.name!r} ({unit.nbytes} bytes) with the root unit ({root.nbytes} "
                    f"bytes) needs {together} bytes, above the high watermark {high}: it can never be "
                    f"resident ({_relief(unit)})" + _kept_whole(unit) + _root_binds(plan, unit))
    pairs = _neighbours(plan)
    for i, (a, b) in enumerate(pairs):
        together = union_bytes(root, a, b)
        if together > high:
            where = ("the last and the first in the order the model declares its cells: the next pass "
                     "starts while this one ends" if i == len(pairs) - 1 else
                     "next to each other in the order the model declares its cells")
            return (f"units {a.name!r} ({a.nbytes} bytes) and {b.name!r} ({b.nbytes} bytes) are {where} "
                    f"(the order they run is known only after a forward, so offload() checks this one); "
                    f"with the root unit ({root.nbytes} bytes) they need {together} bytes, "
                    f"above the high watermark {high}: at lookahead {plan.lookahead} the next unit could "
                    f"never load while one computes (raise device_budget, pass units= with smaller units, "
                    f"or lookahead=0: each unit fits alone)" + _kept_whole(a) + _kept_whole(b))
    return None


def _neighbours(plan):
    """Units resident together beside the root: none at lookahead 0 (a unit is loaded after
    the one before is released, so it runs alone beside the root); at a larger lookahead the
    next unit loads while one computes, so each two consecutive ones and the wrap to the next
    pass (the last and the first)."""
    n = len(plan.units) if plan.lookahead > 0 else 0
    return [(plan.units[i], plan.units[(i + 1) % n]) for i in range(n if n > 1 else 0)]


def _relief(unit):
    """What lets `unit` fit: a larger budget, or smaller units where it has sub-cells to split
    into (one layer's own parameters, a Dense's weight and bias, never split)."""
    layer = unit.cells[0][1] if len(unit.cells) == 1 else None
    if layer is not None and not any(next(c.get_parameters(expand=False), None) is not None
                                     for _, c in layer.cells_and_names() if c is not layer):
        return f"it is one {type(layer).__name__}, with no sub-cell to split it into: raise device_budget"
    return "raise device_budget, or split it: units= / drop its class from no_split="


def _root_binds(plan, unit):
    """Where the root is the larger part of what `unit` needs beside it, what the root holds:
    splitting the unit relieves little there."""
    root = plan.root
    if root.nbytes < unit.nbytes:
        return ""
    return (f"; the root is the larger part: it holds {_short(root.param_names)}"
            + _root_reads(plan.root_reads))


def _root_reads(reads):
    """The reads outside every unit that pinned units' parameters in the root, named (units=
    does not move those: the read does)."""
    if not reads:
        return ""
    return (f"; of those, units' parameters are in the root because a construct outside every unit "
            f"reads them directly: {_first_reads(reads)} (read a weight through its cell's call, "
            f"or by its own path, e.g. self.blocks[1].fc.weight, which pins that one alone)")


def _kept_whole(unit):
    """Why a single-cell unit was not split, if its construct is the reason; else ''. Each
    read is named once: the expression, and the call it goes through (a helper given the cell)."""
    if len(unit.cells) != 1:
        return ""
    cell = unit.cells[0][1]
    own = {id(p) for p in cell.get_parameters(expand=False)}
    reads = list(dict.fromkeys(expr for expr, p in direct_reads(cell) if id(p) not in own))
    if not reads:
        return ""
    return (f"; {unit.name!r} is kept whole because its construct reads {_first_reads(reads)} "
            f"directly, outside that sub-cell's call (units= naming its sub-cells pins those in the root "
            f"instead)")


def _first_reads(reads, limit=3):
    """'a, b, c and N more' of read expressions."""
    more = f" and {len(reads) - limit} more" if len(reads) > limit else ""
    return ", ".join(reads[:limit]) + more


def _short(names, limit=4):
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... ({len(names)} tensors)" if len(names) > limit else "")
