"""Units whose own cell is never called: pinned from the calls of their parts.

A unit is pinned by its cells' forward hooks. Some models never call a unit's
cell, only its parts: a backbone whose stem and stages the model calls one by
one (`self.backbone.stem(x)`, `for stage in self.backbone.stages: ...`), a
plain holder of sub-cells. Nothing would pin such a unit and its weights
would be read unmapped (the process dies). So the layer hooks
(prefetchd/hooks.py) put a probe on every part of every unit, that is every
cell under a unit's cells that holds parameters:

- Recording pass: a probe that fires while no cell of its unit is running is
  an *entry* of that unit. The unit is pinned there (recorded in the trace and
  timed like any unit) and stays pinned until another unit is pinned or the
  pass ends.
- Afterwards, a unit that had entries takes them as cells beside those of its
  own cells that ran: pinned when the first of them starts, released when all
  of them ran, like a unit of merged siblings. Its parts outside those
  entries keep their probe, so a part that first runs in a later pass is
  fetched on demand (held until another unit starts) instead of read unmapped.
- Every other unit's probes are removed after the recording pass: each costs
  a Python call per call of its cell.

Not covered: a unit whose own cell ran in the recording pass and whose parts
alone run in a later one (its probes are gone by then).
"""
from .backend import framework


def part_cells(unit_cells):
    """The cells under `unit_cells` (not those themselves) that hold parameters, in
    definition order. Cells under a compiled (@jit) cell are left out: they run
    inside its graph, where hooks cannot run."""
    ms = framework.mindspore()
    own = {id(c) for c in unit_cells}
    found, seen = [], set()

    def walk(cell):
        if getattr(type(cell).construct, "__wrapped_by_jit__", False):
            return
        for child in cell.name_cells().values():
            if child is None or id(child) in seen or id(child) in own:
                continue
            seen.add(id(child))
            if not any(True for _ in child.get_parameters()):
                continue
            if not isinstance(child, (ms.nn.CellList, ms.nn.CellDict)):   # never called
                found.append(child)
            walk(child)

    for cell in unit_cells:
        walk(cell)
    return found
