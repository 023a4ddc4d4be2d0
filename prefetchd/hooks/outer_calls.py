"""A model's inner cells called on their own, outside its forward: a pass of their own.

The model's forward pre-hook opens a pass: it takes the model's turn and pins the
root unit (embeddings, position tables, final norms) until the forward returns. An
encoder-decoder's generate calls an inner cell directly: `model.get_encoder()(x)`
once, then the model's forward for each token. Such a call opened no pass, so the
root was not pinned, and an encoder that reads a root weight without calling its cell
(Whisper's encoder reads `embed_positions.weight`) read unmapped memory: the process
died (probe N). So every cell between the model and its units (an encoder, a decoder,
a backbone: `outer_cells`) gets the model's pass hooks as well. Called while this
thread runs no pass of the model, it opens one (the turn, the root pinned, the trace
followed or recorded: a pass like any other, keyed in the trace by its first unit)
and closes it when it returns; inside a pass it does nothing (one Python call).
"""
from ..backend import framework
from .construct_reads import is_jit


def outer_cells(model, unit_cells, skip=()):
    """The cells strictly between `model` and `unit_cells` (each an ancestor of a unit's
    cell), innermost first: not those under a unit, not CellList / CellDict (never
    called), not those whose calls run in a compiled graph (a @jit construct or what is
    under it, or `skip`: the cells a @jit method calls), where hooks cannot run."""
    ms = framework.mindspore()
    units = {id(c) for c in unit_cells}
    found, holds = [], {}                 # id(cell) -> whether a unit's cell is at or under it

    def walk(cell):
        if id(cell) in units:
            return True
        if id(cell) not in holds:
            holds[id(cell)] = False       # (a cycle of references ends here)
            if id(cell) not in skip and not is_jit(cell.construct):
                holds[id(cell)] = any([walk(child) for child in cell.name_cells().values() if child is not None])
                if holds[id(cell)] and cell is not model and not isinstance(cell, (ms.nn.CellList,
                                                                                  ms.nn.CellDict)):
                    found.append(cell)
        return holds[id(cell)]

    walk(model)
    return found


class OuterCalls:
    """The pass hooks of the outer cells. `begin(cell)` opens a pass for `cell`'s call (it
    takes the turn); `finish(cell, output)` closes it and returns the output the caller
    gets; `end()` gives the turn back, also when the call raised (an always_call hook)."""

    def __init__(self, turn, begin, finish, end):
        self._turn, self._begin, self._finish, self._end = turn, begin, finish, end
        self._opener = None               # the cell whose call opened the running pass

    def install(self, cells):
        """Hook `cells`; returns the hook handles."""
        handles = []
        for cell in cells:
            handles.append(cell.register_forward_pre_hook(self.before))
            handles.append(cell.register_forward_hook(self.after))
            handles.append(cell.register_forward_hook(self.ended, always_call=True))
        return handles

    def before(self, cell, inputs):
        if self._turn.held_here() and (self._opener is None or self._turn.within(self._opener)):
            return                        # inside a pass (the model's, or an outer call's)
        # (An outer call's pass that a BaseException cut short left the turn here: this one
        # opens the next, as the model's own call would.)
        self._begin(cell)
        self._opener = cell

    def after(self, cell, inputs, output):
        if self._opener is cell and self._turn.held_here():
            return self._finish(cell, output)
        return None

    def ended(self, cell, inputs, output):
        if self._opener is cell and self._turn.held_here():
            self._opener = None
            self._end()
