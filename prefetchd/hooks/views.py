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
import logging

from ..backend import framework
from .outputs import flat_tensors, replaced

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
                _warn_returned_parameters(self._name_of_cell(cell), output, positions)
        positions = self._positions.get(key)
        return output if not positions else copy_positions(output, positions)


def _warn_returned_parameters(cell_name, output, positions):
    """A cell that returns its Parameter itself (a cache, HF-style `past`) hands the caller
    the copy: a write through it (`cache[:] = 0` between sequences) no longer reaches the
    model, where resident it did. Said once, at the recording pass."""
    tensors = flat_tensors(output)
    names = [t.name for i, t in enumerate(tensors) if i in positions and framework.is_parameter(t)]
    if names:
        log.warning("prefetchd.offload: %s returns its Parameter %s itself; the caller gets a copy "
                    "(the weight's pages go once its unit is released), so a write through the "
                    "returned object does not reach the model: write through the cell's attribute, "
                    "inside the forward or `with daemon.use([...])`", cell_name, ", ".join(map(repr, names)))


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
    whole = len(flat_tensors(output)) <= max(positions)
    return replaced(output, None if whole else positions, framework.copy_tensor)
