"""Cells compiled with mindspore.jit after offload().

The planner (prefetchd/hooks/planner.py) handles cells compiled before offload(): a
compiled cell streams whole. A user may also compile later
(`cell.construct = mindspore.jit(cell.construct)` between passes). MindSpore
then compiles the forward hooks of the cells called inside that graph into it,
where prefetchd's hooks cannot run (they fail to compile, or would run once,
when tracing). So, before each pass:

- a unit's own cell compiled since: the probes on its parts go
  (prefetchd.hooks.parts); the unit's own hooks stay outside its graph and pin it
  whole, as if it had been compiled before offload();
- a cell holding units (the model, a block split into units) compiled since:
  refused by name, since their hooks would be inside its graph.

The hooks call `refuse_compiled_holders` and `drop_probes_under_compiled` at
the start of each pass.

`mindspore.jit(model)`, a function over the model's construct, calls no hook
of the model at all and cannot be seen from here: it is not supported.
"""
import logging

from .construct_reads import is_jit
from ..errors import PrefetchdError

log = logging.getLogger("prefetchd.hooks")


class CompiledLater:
    def __init__(self, model, units, planned_units, parts, name_of):
        """units: the hooks' Unit objects (their `cells` grow when parts' entries are adopted);
        planned_units: the planner's; parts: the prefetchd.hooks.parts.PartProbes on their parts;
        name_of(cell): the cell's name in the model, for the log."""
        self._units = units
        self._compiled = {id(c) for u in units for c in u.cells if is_jit(c.construct)}
        self._holders = _unit_holders(model, planned_units)
        self._model = model
        self._parts = parts
        self._name_of = name_of

    def refuse_compiled_holders(self):
        """Before a pass: PrefetchdError if a cell holding units was compiled since offload()."""
        for name, holder in self._holders:
            if is_jit(holder.construct):
                where = f"the construct of {name!r}" if name else f"this {type(self._model).__name__}'s construct"
                raise PrefetchdError(
                    f"prefetchd: {where} was compiled with mindspore.jit after offload(), and it "
                    f"holds units (their hooks would be compiled into its graph, where they cannot run). "
                    f"Compile it before offload(): prefetchd then streams a compiled cell whole (the model "
                    f"itself: as one root unit, which must fit the budget)")

    def drop_probes_under_compiled(self):
        """Before a pass, holding the model's pass lock: the probes under unit cells compiled
        since go (their unit streams whole)."""
        for unit in self._units:
            for cell in unit.cells:
                if id(cell) not in self._compiled and is_jit(cell.construct):
                    self._compiled.add(id(cell))
                    self._parts.drop_under(cell)
                    log.info("prefetchd.offload: %s was compiled after offload(); it streams whole",
                             self._name_of(cell))


def _unit_holders(model, planned_units):
    """(name, cell) of each cell above a unit's cell (the model, blocks split into units)."""
    prefixes = set()
    for unit in planned_units:
        for name, _ in unit.cells:
            parts = name.split(".")
            prefixes.update(".".join(parts[:i]) for i in range(len(parts)))
    return [(name, cell) for name, cell in model.cells_and_names() if name in prefixes]
