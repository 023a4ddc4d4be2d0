"""Outputs that are views of a unit's own weights, copied before the unit is released.

A cell may return a view of its own parameter: `self.pos_embed[:, :n]`,
`self.weight.T`, a reshape, or the Parameter itself. A MindSpore view shares
the parameter's storage, so once the unit is released the caller would read
pages that are no longer mapped (stable addresses: the process dies) or a
block already reused for another tensor (a rebinding backend: silent garbage).

Telling a view from a fresh tensor needs its address (`Tensor._data_ptr`),
and asking waits for MindSpore's whole op queue to drain. The recording pass
can afford that (it waits for each unit's compute anyway, to time it), so it
finds which outputs of which cells are views (`view_positions`); every pass
copies those outputs (`copy_positions`) while the unit is still pinned, so the
copy is dispatched before the fence behind the unit's kernels. A cell that
returns a view only on passes after the recording one is not covered.

`ViewCopies` keeps which outputs of which cells those are, per unit; the layer
hooks (prefetchd/hooks/offload.py) pass every output that leaves a unit (a unit's
cell, an entry part, the model for the root unit) through it.
"""
import copy
import dataclasses
import itertools
import logging
import types

from ..backend import framework

log = logging.getLogger("prefetchd.hooks")


class ViewCopies:
    """The outputs of cells that are views of their unit's weights: found in the recording
    pass, copied while the unit is pinned, on every pass. name_of_cell: fn(cell) -> its
    name in the model, for the log line."""

    def __init__(self, name_of_cell):
        self._name_of_cell = name_of_cell
        # (id(unit), id(cell)) -> positions in flat_tensors of its outputs that are views
        self._positions = {}

    def copied(self, unit, cell, output, recording):
        """`output` of `cell`, with what are views of `unit`'s weights copied. `unit`: its
        `records` (the daemon's, with bound addresses) and `name`."""
        key = (id(unit), id(cell))
        if recording:
            positions = view_positions(output, unit.records)
            if positions:
                self._positions[key] = positions
                log.info("prefetchd.offload: %s returns a view of the weights of unit %r; that output "
                         "is copied before the unit is released", self._name_of_cell(cell), unit.name)
        positions = self._positions.get(key)
        return output if not positions else copy_positions(output, positions)


def flat_tensors(value, _seen=None):
    """The tensors in `value` (nested tuples, lists, dict values, and the fields of
    dataclass instances and SimpleNamespaces: model outputs), in a fixed order. A container
    met again (a cycle: a parent pointer) is not walked again."""
    ms = framework.mindspore()
    if isinstance(value, ms.Tensor):
        return [value]
    items = _items(value)
    if items is None:
        return []
    seen = set() if _seen is None else _seen
    if id(value) in seen:
        return []
    seen.add(id(value))
    return [t for v in items for t in flat_tensors(v, seen)]


def _items(value):
    """The values a container holds, in order; None for anything else."""
    if isinstance(value, (tuple, list)):
        return value
    if isinstance(value, dict):
        return list(value.values())
    fields = _fields(value)
    return None if fields is None else list(fields.values())


def _fields(value):
    """{name: value} of a dataclass instance's fields or a SimpleNamespace's attributes;
    None for anything else (an arbitrary object is not walked: a cache may hold thousands)."""
    if isinstance(value, types.SimpleNamespace):
        return vars(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if hasattr(value, f.name)}
    return None


def view_positions(output, records):
    """Positions in flat_tensors(output) of the tensors whose bytes lie inside one of
    `records`' device replicas (their bound addresses). Waits for the op queue."""
    spans = [(rec.bound_address, rec.bound_address + rec.nbytes) for rec in records
             if rec.bound_address and rec.nbytes]
    if not spans:
        return ()
    found = []
    for position, tensor in enumerate(flat_tensors(output)):
        if tensor.size == 0:
            continue                     # reads no byte
        address = tensor._data_ptr()
        if any(start <= address < end for start, end in spans):
            found.append(position)
    return tuple(found)


def copy_positions(output, positions):
    """`output` with the tensors at `positions` (of flat_tensors) replaced by copies.
    A structure that changed since the positions were found is copied whole."""
    wanted = set(positions)
    if len(flat_tensors(output)) <= max(wanted):
        wanted = None                    # every tensor
    counter = itertools.count()

    copies = {}                          # id(container) -> its copy

    def rebuild(value):
        ms = framework.mindspore()
        if isinstance(value, ms.Tensor):
            return value.copy() if wanted is None or next(counter) in wanted else value
        if _items(value) is None:
            return value
        if id(value) not in copies:
            copies[id(value)] = value        # a cycle back to a tuple or dict being built: itself
            copies[id(value)] = _rebuilt(value, rebuild, copies)
        return copies[id(value)]

    return rebuild(output)


def _rebuilt(value, rebuild, copies):
    """A copy of the container `value` holding rebuild(item) for each item. A list, dataclass
    instance or SimpleNamespace is made, and entered in `copies`, before its items are rebuilt:
    a cycle back to it (a parent pointer) reaches the copy."""
    if isinstance(value, dict):       # (also a model-output class that is a dataclass too)
        return type(value)((k, rebuild(v)) for k, v in value.items())
    if type(value) is list:
        new = copies[id(value)] = []
        for v in value:
            new.append(rebuild(v))
        return new
    fields = _fields(value)
    if fields is not None:
        new = copies[id(value)] = copy.copy(value)
        for name, v in fields.items():
            object.__setattr__(new, name, rebuild(v))     # (a frozen dataclass refuses setattr)
        return new
    items = [rebuild(v) for v in value]
    return type(value)(items) if type(value) is tuple else _same_kind(value, items)


def _same_kind(value, items):
    """A namedtuple (or list subclass) rebuilt with new items."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*items)
    return type(value)(items)
