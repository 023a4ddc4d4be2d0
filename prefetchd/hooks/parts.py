"""Units whose own cell is never called: pinned from the calls of their parts.

A unit is pinned by its cells' forward hooks. Some models never call a unit's
cell, only its parts: a backbone whose stem and stages the model calls one by
one (`self.backbone.stem(x)`, `for stage in self.backbone.stages: ...`), a
plain holder of sub-cells. Nothing would pin such a unit and its weights
would be read unmapped (the process dies). So the layer hooks
(prefetchd/hooks/offload.py) put a probe on every part of every unit, that is every
cell under a unit's cells that holds parameters:

- Recording pass: a probe that fires while no cell of its unit is running is
  an *entry* of that unit. The unit is pinned there (recorded in the trace and
  timed like any unit) and stays pinned until another unit is pinned or the
  pass ends.
- Afterwards, a unit that had entries takes them as cells beside those of its
  own cells that ran: pinned when the first of them starts, released when all
  of them ran, like a unit of merged siblings.
- Every other part keeps its pre-probe (the post-probes go: part depths matter
  while recording only), so a part that first runs alone in a later pass (a
  branch the recording pass did not take, `self.blocks[0].mlp(x)` after the
  blocks) is fetched on demand and held until another unit starts, instead of
  read unmapped. A probe inside its unit's running call returns at once: one
  Python call per call of the part, beside MindSpore's dispatch of the part's
  own ops.
"""
from ..backend import framework
from .construct_reads import is_jit


class PartProbes:
    """The probes on the parts of a model's units, and what they saw. No pinning here:
    `entry` says which unit a part's call must pin, the layer hooks pin it.

    Units are hooks.Unit objects: this class keeps their entries, part_depth and
    last_output; the hooks set own_ran and parted when they pin."""

    def __init__(self, units, unit_cell_ids, before, after, skip=()):
        self._of = {}          # id(part) -> the units it is part of (a shared cell: several)
        self._probes = {}      # id(part) -> its probe hooks' handles
        for unit in units:
            for part in part_cells(unit.cells, skip):
                if id(part) in unit_cell_ids:
                    continue
                self._of.setdefault(id(part), []).append(unit)
                if id(part) not in self._probes:
                    self._probes[id(part)] = [part.register_forward_pre_hook(before),
                                              part.register_forward_hook(after, always_call=True)]

    def entry(self, cell, recording):
        """Before `cell` (a part) runs: the unit its call must pin, or None."""
        units = self._of[id(cell)]
        if _inside_own_call(units):
            return None
        unit = units[0]
        if not recording:
            return None if unit.held else unit             # a part no recorded call reached
        entering = None
        if unit.part_depth == 0:                           # no other part of it runs: an entry
            if all(e is not cell for e in unit.entries):
                unit.entries.append(cell)
            entering = None if unit.held else unit
        unit.part_depth += 1
        return entering

    def unit_of(self, cell):
        return self._of[id(cell)][0]

    def called_inside_another(self, cell):
        """Whether `cell`, an entry adopted by its unit (the first one it is part of), is called
        inside the own call of another unit it is also part of (a cell several units share),
        which holds its weights already: not an entry there, as in the recording pass."""
        return _inside_own_call(self._of.get(id(cell), ()))

    def ran(self, cell, output, recording):
        """After `cell` (a part) ran; its output is the fence behind its unit's part calls."""
        unit = self._of[id(cell)][0]
        if recording and unit.parted:
            unit.part_depth = max(0, unit.part_depth - 1)
            if output is not None:
                unit.last_output = output

    def adopt(self, units, hook_unit_cell):
        """After the recording pass: each unit entered by its parts takes its entries as
        cells (hook_unit_cell(cell) hooks each); probes stay on its parts outside them,
        the post-probes go. Returns the units that had entries."""
        parted = [u for u in units if u.entries]
        for unit in parted:
            unit.cells = (unit.cells if unit.own_ran else []) + unit.entries
            for cell in unit.entries:
                for handle in self._probes.pop(id(cell)):
                    handle.remove()
                hook_unit_cell(cell)
        # A part inside an entry runs while the entry holds its unit: no probe needed.
        inside = {id(c) for u in parted for e in u.entries for _, c in e.cells_and_names()}
        for key in list(self._probes):
            pre, post = self._probes[key]
            post.remove()                                  # part depths matter while recording only
            if key in inside:
                pre.remove()
                del self._probes[key]
            else:
                self._probes[key] = [pre]
        for unit in units:
            unit.last_output = None
        return parted

    def drop_under(self, cell):
        """Remove the probes of the parts under `cell` (compiled since: they run in its graph)."""
        for _, part in cell.cells_and_names():
            for handle in self._probes.pop(id(part), ()):
                handle.remove()

    def handles(self):
        """The handles of the probes in place now."""
        return [handle for handles in self._probes.values() for handle in handles]

    def remove(self):
        for handles in self._probes.values():
            for handle in handles:
                handle.remove()
        self._probes.clear()


def _inside_own_call(units):
    """Whether one of `units` is pinned by a call of its own cells (not by a part's)."""
    return any(u.held and not u.parted for u in units)


def part_cells(unit_cells, skip=()):
    """The cells under `unit_cells` (not those themselves) that hold parameters, in
    definition order. Cells under a compiled (@jit) cell, and those in `skip` (ids of
    cells a @jit method calls: prefetchd.hooks.planner) with what is under them, are left
    out: they run inside a graph, where hooks cannot run (MindSpore would compile
    the hook into the graph, and run it once, when tracing)."""
    ms = framework.mindspore()
    own = {id(c) for c in unit_cells}
    found, seen = [], set()

    def walk(cell):
        if is_jit(cell.construct):                  # on the class or set on the instance
            return
        for child in cell.name_cells().values():
            if child is None or id(child) in seen or id(child) in own or id(child) in skip:
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
