"""The candidate units of a model: which cells stream together, before the root is settled.

The planner (prefetchd.hooks.planner) asks for candidates in two ways and keeps
the first plan that fits:

- `block_units`: the repeated blocks at any depth (the items of every
  CellList/SequentialCell, repeated composite siblings of one class), each
  split into its children while above the unit share. Everything outside the
  blocks is the root.
- `called_units`: every called cell that owns parameters can be a unit: the
  model's children are split top-down while above the share, so embeddings,
  heads, classifiers, stems, a block applied N times, cells called in any
  order are units of their own. Only what no call can own stays in the root
  (parameters of the model itself, parameters a construct reads directly).
  The recording pass's trace orders the units; a cell reached from two places
  (T5's `shared` embedding is also `encoder.embed_tokens`) is one unit, and a
  unit inside another unit's cells is dropped (the outer pins its parameters).

A cell whose construct reads a sub-cell's weight directly is kept whole, so the
read is pinned with it; the last search (`Search.split_readers`) splits such a
cell instead, and the root pins only the weights it reads (WhisperEncoder reads
its 8 KiB position table, RWKV's model rescales six block weights: kept whole,
each was one unit of most of the model).

`Facts` caches what the search asks of cells (parameters, direct reads): the
budget hint re-plans a model many times (prefetchd.hooks.budget_hint).
"""
from typing import NamedTuple

from ..backend import framework
from .construct_reads import direct_reads, is_jit


class Facts:
    """Per-cell facts the search needs, computed once per plan_units call."""

    def __init__(self, no_split, size, jit):
        self.no_split, self.size, self.jit = no_split, size, jit
        self._has_params, self._reads, self._params, self._nbytes = {}, {}, {}, {}
        self._subtree, self._reads_within = {}, {}

    def has_params(self, cell):
        key = id(cell)
        if key not in self._has_params:
            self._has_params[key] = any(True for _ in cell.get_parameters())
        return self._has_params[key]

    def params(self, cell):
        key = id(cell)
        if key not in self._params:
            self._params[key] = list({id(p): p for p in cell.get_parameters()}.values())
        return self._params[key]

    def direct_reads(self, cell):
        key = id(cell)
        if key not in self._reads:
            self._reads[key] = direct_reads(cell)
        return self._reads[key]

    def cells_of(self, cell):
        """`cell` and every cell under it, each once (cells_and_names' order)."""
        key = id(cell)
        if key not in self._subtree:
            self._subtree[key] = [c for _, c in cell.cells_and_names()]
        return self._subtree[key]

    def subtree_ids(self, cell):
        return [id(c) for c in self.cells_of(cell)]

    def reads_within(self, cell):
        """The Parameters that constructs of `cell` and the cells under it read directly."""
        key = id(cell)
        if key not in self._reads_within:
            self._reads_within[key] = [p for inner in self.cells_of(cell) for _, p in self.direct_reads(inner)]
        return self._reads_within[key]

    def reads_descendants(self, cell):
        """True if cell's construct reads a Parameter of one of its sub-cells directly."""
        own = {id(p) for p in cell.get_parameters(expand=False)}
        return any(id(p) not in own for _, p in self.direct_reads(cell))

    def nbytes(self, cell):
        key = id(cell)
        if key not in self._nbytes:
            self._nbytes[key] = sum(self.size(p) for p in self.params(cell))
        return self._nbytes[key]


def _nn():
    return framework.mindspore().nn


def is_container(cell):
    nn = _nn()
    return isinstance(cell, (nn.CellList, nn.SequentialCell))


def is_uncalled(cell):
    """Containers that are iterated or indexed, never called: their hooks never fire."""
    nn = _nn()
    return isinstance(cell, (nn.CellList, nn.CellDict))


def is_compiled(cell):
    """True if `cell`'s construct is wrapped by mindspore.jit: @jit on the class's construct, or
    `cell.construct = mindspore.jit(cell.construct)` on the instance (MindSpore marks the wrapper)."""
    return is_jit(cell.construct)


def join(prefix, name):
    return f"{prefix}.{name}" if prefix else name


def parent_name(name):
    return name.rsplit(".", 1)[0] if "." in name else ""


def find_blocks(cell, prefix, facts):
    """(name, cell) of the repeated blocks under `cell`, top-down, in definition order.
    Cells that run inside a @jit method's graph (`facts.jit`) are neither blocks nor searched."""
    if is_compiled(cell):
        return []
    children = [(n, c) for n, c in cell.name_cells().items()
                if c is not None and facts.has_params(c) and id(c) not in facts.jit]
    if is_container(cell):
        found = []
        for name, child in children:
            qualified = join(prefix, name)
            found.extend(find_blocks(child, qualified, facts) if is_container(child) else [(qualified, child)])
        return found
    counts = {}
    for _, child in children:
        if not is_container(child) and child.name_cells():
            counts[type(child)] = counts.get(type(child), 0) + 1
    found = []
    for name, child in children:
        qualified = join(prefix, name)
        if counts.get(type(child), 0) >= 2:
            found.append((qualified, child))
        else:
            found.extend(find_blocks(child, qualified, facts))
    return found


def split(name, cell, share, facts, keep_owners=False, split_readers=False):
    """(name, [cells]) candidates for `cell`: itself if it fits `share`, else its children's."""
    children = [(n, c) for n, c in cell.name_cells().items() if c is not None and facts.has_params(c)]
    if children and is_uncalled(cell):
        whole = False                 # its hooks would never fire: its items are the units
    else:
        no_split = facts.no_split
        whole = facts.nbytes(cell) <= share or not children or (no_split and isinstance(cell, no_split)) \
            or is_compiled(cell) or (not split_readers and facts.reads_descendants(cell)) \
            or any(id(c) in facts.jit for _, c in children) \
            or (keep_owners and any(True for _ in cell.get_parameters(expand=False)))
    if whole:
        return [(name, [(name, cell)])]
    parts = []
    for child_name, child in children:
        parts.extend(split(join(name, child_name), child, share, facts, keep_owners, split_readers))
    return parts


def block_units(model, share, facts, keep_owners):
    """The blocks' candidates, split to `share`; a cell several split blocks hold is dropped."""
    chosen = []
    for name, cell in find_blocks(model, "", facts):
        chosen.extend(split(name, cell, share, facts, keep_owners))
    return _drop_shared(chosen)


def called_units(model, share, facts, keep_owners, split_readers=False):
    """Every called cell that owns parameters as a candidate, split top-down to `share`."""
    if is_compiled(model):
        return []                     # one graph: its cells' hooks never fire
    chosen = []
    for name, child in model.name_cells().items():
        if child is not None and facts.has_params(child) and id(child) not in facts.jit:
            chosen.extend(split(name, child, share, facts, keep_owners, split_readers))
    return _drop_nested(chosen)


class Search(NamedTuple):
    """One way to cut a model into candidate units; the planner tries SEARCHES in order and
    keeps the first plan that fits."""
    called: bool                  # every called cell (called_units), else the blocks (block_units)
    keep_owners: bool = False     # a cell owning parameters itself is never split
    split_readers: bool = False   # a cell reading a sub-cell's weight is split (the root pins the weight)

    def units(self, model, share, facts):
        if self.called:
            return called_units(model, share, facts, self.keep_owners, self.split_readers)
        return block_units(model, share, facts, self.keep_owners)


SEARCHES = (Search(False), Search(False, keep_owners=True),
            Search(True), Search(True, keep_owners=True), Search(True, split_readers=True))


def _drop_shared(units):
    """Units whose cell is a unit of several split blocks too (one rotary-embedding cell that
    every layer holds) are dropped: the cell's hooks can pin one unit only, so every other
    block's unit would wait for a call that never comes and stay pinned to the pass end.
    Its parameters go to the root (they are read by every block anyway)."""
    count = {}
    for _, cells in units:
        for _, cell in cells:
            count[id(cell)] = count.get(id(cell), 0) + 1
    return [u for u in units if all(count[id(cell)] == 1 for _, cell in u[1])]


def _drop_nested(units):
    """One unit per cell (the first name it was reached by), and none inside another unit's
    cells: the outer unit pins its parameters whenever it runs, and a call from outside it
    is a call of one of its parts, which pins the outer unit (prefetchd.hooks.parts)."""
    inside = set()
    for _, cells in units:
        for _, cell in cells:
            inside.update(id(c) for _, c in cell.cells_and_names() if c is not cell)
    kept, seen = [], set()
    for name, cells in units:
        ids = [id(cell) for _, cell in cells]
        if any(i in inside or i in seen for i in ids):
            continue
        seen.update(ids)
        kept.append((name, cells))
    return kept
