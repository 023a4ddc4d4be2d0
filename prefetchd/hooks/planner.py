"""Unit planning: which cells of a model stream through the device tier together.

A *unit* is a set of cells whose parameters are pinned together while they
compute. `plan_units(model, high_watermark, lookahead)` walks the cell tree
(no daemon, no side effects) and returns a `Plan`: the units, and the ROOT
unit that holds every parameter no unit owns, pinned for the whole forward.
The rules it follows are stated once, in docs/offload.md; in short:

- blocks are the items of CellLists/SequentialCells and repeated composite
  siblings of one class, at any depth; a unit above its share of the budget,

      unit_share = (high_watermark - root bytes) // (2 + lookahead)

  (the root, the unit computing, `lookahead` prefetched units and one more for
  the previous unit's memory waiting on its compute fence), is split into its
  children, and tiny neighbours (under unit_share / 8) merge;
- if no blocks-only plan fits, every called cell that owns parameters can be a
  unit (prefetchd.hooks.unit_search.called_units); last, cells reading a
  sub-cell's weight are split too, the root pinning the weights they read;
- units are sized for the plan's lookahead first, then for finer shares (up to
  lookahead _FINEST_SIZING's), so a smaller lookahead never needs more budget;
- weights a construct reads directly (construct_reads) stay pinned: the block
  reading them is not split, or they go to the root; cells a @jit method runs
  are never units (jit_graphs); `units=` and `no_split=` override the search.

`Plan.check_fits()` raises BudgetError for what can never run: a tensor or a
unit larger than the high watermark beside the root (at lookahead 0 a unit is
loaded after the one before is released), or, at a lookahead >= 1, a root plus
two consecutive units (including the wrap from the last to the first) above
it (the rules: prefetchd.hooks.plan_fit), naming what binds in the plan tried that
needs the least. The message ends with the smallest device_budget under which
re-planning the same model fits (Plan.min_device_budget), at the plan's lookahead
and at 0: the bisection and the text are prefetchd.hooks.budget_hint's.
"""
from dataclasses import dataclass, field

import numpy as np

from .budget_hint import DEFAULT_HIGH_FRACTION, budget_for_high_watermark, hint_text, lowest_fitting
from ..errors import BudgetError, PrefetchdError
from .plan_fit import need, problem, union_bytes
from .jit_graphs import cells_in_jit_graphs, refuse_units_in_jit_graphs
from .unit_search import SEARCHES, Facts, Search, is_compiled, is_uncalled, parent_name

ROOT_NAME = "<root>"
_MERGE_FRACTION = 8          # siblings under unit_share / 8 are "tiny"
_MAX_ROUNDS = 6              # splitting moves bytes to the root; the share shrinks; re-plan
# Unit sizings tried: the plan's lookahead up to this one (finer units). A plan that fits at a
# larger lookahead is then a candidate at every smaller one: no smaller lookahead needs more.
_FINEST_SIZING = 6


def param_nbytes(p):
    """Bytes of a parameter from its shape and dtype (works for uninitialised parameters)."""
    return int(np.prod(p.shape, dtype=np.int64)) * int(p.itemsize)


@dataclass
class PlannedUnit:
    """Cells streamed together; `params` are unique Parameter objects, `nbytes` the device
    bytes they reserve (`size` of each: its bytes rounded up to the device's block)."""
    name: str
    cells: list = field(default_factory=list)      # [(qualified name, cell)]
    params: list = field(default_factory=list)
    nbytes: int = 0
    size: object = param_nbytes                    # fn(Parameter) -> device bytes it reserves
    # ids of `params`, kept beside it: rebuilt on every add_params, it was most of the time
    # the budget hint's re-planning took (a 96-block model's refusal: 20 s)
    _ids: set = field(default_factory=set, repr=False, compare=False)

    @property
    def param_names(self):
        return [p.name for p in self.params]

    def add_params(self, params):
        if len(self._ids) != len(self.params):       # params given to the constructor
            self._ids = {id(p) for p in self.params}
        for p in params:
            if id(p) not in self._ids:
                self._ids.add(id(p))
                self.params.append(p)
                self.nbytes += self.size(p)


@dataclass
class Plan:
    """The units of one model, its root unit, and the budget figures they were sized for."""
    units: list
    root: PlannedUnit
    high_watermark: int
    unit_share: int
    lookahead: int
    total_bytes: int
    explicit: bool = False
    compiled_model: bool = False   # the model's own construct is @jit: every parameter is root
    root_reads: tuple = ()         # reads of units' parameters by constructs outside every unit
    replan: object = None          # fn(high_watermark, lookahead) -> the Plan with the same inputs
    high_fraction: float = DEFAULT_HIGH_FRACTION   # high watermark / device_budget, for the hint
    # ids of the cells that run inside a @jit method's graph: never hooked (prefetchd.hooks.parts)
    jit_cells: frozenset = frozenset()

    def fits(self):
        return self._problem() is None

    def check_fits(self):
        """Raise BudgetError naming what can never fit under the high watermark, and the
        smallest device_budget under which the same model, units= and no_split= would plan
        units that fit (at this lookahead and at lookahead 0)."""
        problem = self._problem()
        if problem is not None:
            raise BudgetError(problem + self.budget_hint())

    def min_high_watermark(self, lookahead=None):
        """The smallest high watermark (bytes) at which re-planning with the same inputs gives a
        plan that fits, at `lookahead` (default: this plan's); None if it cannot be re-planned.
        Found by bisection over the planner itself (prefetchd.hooks.budget_hint): the plan at the
        result fits and the one a byte below does not."""
        if self.replan is None:
            return None
        lookahead = self.lookahead if lookahead is None else lookahead
        return lowest_fitting(lambda high: self.replan(high, lookahead).fits(),
                              max(union_bytes(self.root, *self.units), 1))

    def min_device_budget(self, lookahead=None):
        """The smallest device_budget whose high watermark (`high_fraction` of it, as the
        Config sets it when high_watermark is not given) is min_high_watermark(lookahead)."""
        high = self.min_high_watermark(lookahead)
        return None if high is None else budget_for_high_watermark(high, self.high_fraction)

    def budget_hint(self):
        """'; ... device_budget >= ... at lookahead k (lookahead 0: ...)', or '' (no replan)."""
        return hint_text(self.min_high_watermark, self.lookahead, self.high_fraction,
                         resident=union_bytes(self.root, *self.units))

    def _problem(self):
        """What can never fit under the high watermark (a message), or None."""
        return problem(self)

    def need(self):
        """The smallest high watermark under which this plan, as it is, fits (bytes)."""
        return need(self)

    def format_table(self):
        width = max([len(u.name) for u in self.units] + [len(ROOT_NAME), 4])
        # Bytes as the device reserves them (each tensor rounded to the backend's block), so the
        # shares are of their sum, which can exceed the parameters' own bytes.
        listed = sum(u.nbytes for u in [self.root, *self.units])
        lines = [f"{'unit':<{width}}  {'params':>6}  {'bytes':>12}  {'share':>6}"]
        for unit in [self.root, *self.units]:
            share = unit.nbytes / listed if listed else 0.0
            lines.append(f"{unit.name:<{width}}  {len(unit.params):>6}  {unit.nbytes:>12}  {share:>6.1%}")
        lines.append(f"{len(self.units)} units + root; {listed} bytes on the device in all ({self.total_bytes} "
                     f"bytes of parameters); high watermark "
                     f"{self.high_watermark}; unit share {self.unit_share} (lookahead {self.lookahead})"
                     + ("; units given explicitly" if self.explicit else ""))
        return "\n".join(lines)


def fitting_plan(model, high_watermark, lookahead, *, auto, high_fraction=None, **planning):
    """(plan, lookahead) of plan_units at `lookahead`, or BudgetError where its units cannot fit
    (check_fits); with `auto` ("auto": the cost model picks the lookahead later, from what the
    budget allows), at the largest lookahead up to the given one that fits: a budget where only
    lookahead 0 fits was refused for a lookahead nobody chose. high_fraction: the daemon's high
    watermark over its budget, where it is not the default's (the refusal's suggested budget)."""
    while True:
        plan = plan_units(model, high_watermark, lookahead, **planning)
        if high_fraction is not None:
            plan.high_fraction = high_fraction
        try:
            plan.check_fits()
            return plan, lookahead
        except BudgetError:
            if not auto or lookahead == 0:
                raise
            lookahead -= 1


def plan_units(model, high_watermark, lookahead, units=None, no_split=(), block_bytes=None):
    """Plan `model`'s units for a device tier whose high watermark is `high_watermark` bytes.
    block_bytes: fn(nbytes) -> what a tensor of nbytes reserves on the device (the backend's
    block_bytes: a 4 KiB page on cpu, a 2 MiB granule under ACL/CUDA virtual memory);
    None: the tensor's own bytes.
    Raises PrefetchdError if a cell the hooks would hook runs inside a @jit method's graph."""
    no_split = _no_split_classes(model, no_split)
    reserve = param_nbytes if block_bytes is None else (lambda p: int(block_bytes(param_nbytes(p))))
    sizes = {}

    def size(p):                      # re-planned many times by the budget hint: sized once
        key = id(p)
        if key not in sizes:
            sizes[key] = reserve(p)
        return sizes[key]
    jit = cells_in_jit_graphs(model)
    facts = Facts(no_split, size, jit)
    plan = _plan(model, high_watermark, lookahead, units, facts)
    plan.jit_cells = frozenset(jit)
    refuse_units_in_jit_graphs(model, plan, jit)

    def replan(high, lookahead):
        return _plan(model, high, lookahead, units, facts)
    plan.replan = replan
    return plan


def _no_split_classes(model, no_split):
    """no_split= as a tuple of classes: cell classes, or class names (Accelerate's
    no_split_module_classes style) of cells in `model`. Anything else is refused by name."""
    if isinstance(no_split, (str, type)):
        no_split = (no_split,)
    present = {}
    for _, cell in model.cells_and_names():
        present.setdefault(type(cell).__name__, type(cell))
    classes = []
    for item in no_split or ():
        if isinstance(item, type):
            classes.append(item)
        elif isinstance(item, str):
            if item not in present:
                raise ValueError(f"prefetchd.offload: no_split={item!r} names no cell class of this model "
                                 f"(no_split takes cell classes or class names, not cell paths; classes "
                                 f"here: {', '.join(sorted(present))})")
            classes.append(present[item])
        else:
            raise TypeError(f"prefetchd.offload: no_split takes cell classes or class names, got {item!r}")
    return tuple(classes)


def _plan(model, high, lookahead, units, facts):
    all_params = _unique(model.get_parameters())
    total = sum(param_nbytes(p) for p in all_params)
    if units is not None:
        chosen = [_make_unit(name, [(name, cell)], facts) for name, cell in _resolve(model, units)]
        return _finish(model, chosen, all_params, high, lookahead, lookahead, total, facts, explicit=True)
    if max((facts.size(p) for p in all_params), default=0) > high:
        # A tensor above the high watermark: no plan fits (the refusal names it).
        return _search(model, Search(called=True), lookahead, high, lookahead, all_params, total, facts)
    closest = None
    for sizing in range(lookahead, max(lookahead, _FINEST_SIZING) + 1):
        # The blocks first (the rest pinned in the root); splitting moves a block's own
        # parameters to the root, so keeping such blocks whole may fit where that did not;
        # then every called cell as a unit (embeddings, heads, stems...): the root keeps only
        # what no call can own; last, cells reading a sub-cell's weight split too (SEARCHES).
        for search in SEARCHES:
            plan = _search(model, search, sizing, high, lookahead, all_params, total, facts)
            key = (plan.need(), not search.called)
            if key[0] <= high:       # it fits
                return plan
            # The refusal names the plan closest to fitting (on a tie, the finest-grained):
            # what binds there is what a larger budget relieves.
            if closest is None or key < closest[0]:
                closest = (key, plan)
    return closest[1]


def _search(model, search, sizing, high, lookahead, all_params, total, facts):
    share = high
    for _ in range(_MAX_ROUNDS):
        chosen = [_make_unit(name, cells, facts) for name, cells in search.units(model, share, facts)]
        plan = _finish(model, _merge(chosen, share), all_params, high, lookahead, sizing, total, facts)
        if plan.unit_share >= share:   # stable: no unit was sized for a larger share
            return plan
        share = plan.unit_share
    return plan


def _merge(units, share):
    """Merge consecutive sibling units when one of them is tiny and the result fits `share`."""
    tiny = share // _MERGE_FRACTION
    merged = []
    for unit in units:
        last = merged[-1] if merged else None
        if last is not None and parent_name(last.cells[-1][0]) == parent_name(unit.cells[0][0]) \
                and (last.nbytes < tiny or unit.nbytes < tiny) and union_bytes(last, unit) <= share:
            combined = PlannedUnit(f"{last.name}+{unit.cells[0][0].rsplit('.', 1)[-1]}",
                                   last.cells + unit.cells, size=last.size)
            combined.add_params(last.params)
            combined.add_params(unit.params)
            merged[-1] = combined
        else:
            merged.append(unit)
    return merged


def _finish(model, units, all_params, high, lookahead, sizing, total, facts, explicit=False):
    in_units = {id(p) for u in units for p in u.params}
    root = PlannedUnit(ROOT_NAME, [], size=facts.size)
    root.add_params(p for p in all_params if id(p) not in in_units)
    # A unit's parameter that a construct running outside every unit reads directly
    # (a tied table read by the model's construct) is pinned by the root as well.
    reads = [(expr, p) for cell in _outside_units(model, units, facts) for expr, p in facts.direct_reads(cell)
             if id(p) in in_units]
    root.add_params(p for _, p in reads)
    share = max((high - root.nbytes) // (2 + sizing), 0)
    return Plan(units, root, high, share, lookahead, total, explicit, compiled_model=is_compiled(model),
                root_reads=tuple(dict.fromkeys(expr for expr, _ in reads)))


def _outside_units(model, units, facts):
    """The cells whose constructs run outside every unit: the model and the cells above units."""
    inside = {key for u in units for _, cell in u.cells for key in facts.subtree_ids(cell)}
    return [cell for cell in facts.cells_of(model) if id(cell) not in inside]


def _make_unit(name, cells, facts):
    unit = PlannedUnit(name, list(cells), size=facts.size)
    for _, cell in cells:
        unit.add_params(facts.params(cell))
    # A construct in the unit that reads a weight of a cell outside it (one kept in a plain
    # list attribute: `self._refs[0].weight`) runs while the unit is pinned: the weight is
    # pinned with it (a Parameter may be in several units, as a tied table is).
    for _, cell in cells:
        unit.add_params(facts.reads_within(cell))
    return unit


def _resolve(model, units):
    """Explicit units: (name, cell) pairs or cell names; each a distinct sub-cell, none inside another."""
    by_name = {name: cell for name, cell in model.cells_and_names() if name}
    if isinstance(units, str):
        units = [units]          # one name, as no_split= takes one (it was read letter by letter)
    resolved, missing = [], []
    for item in units:
        if isinstance(item, str):
            if item in by_name:
                resolved.append((item, by_name[item]))
            else:
                missing.append(item)
            continue
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise PrefetchdError(f"units=: {item!r} is neither a cell name nor a (name, cell) pair")
        name, cell = item
        if cell is model:
            raise PrefetchdError(f"units=: {name!r} is the model itself; its parameters form the root unit")
        if all(c is not cell for c in by_name.values()) or by_name.get(name, cell) is not cell:
            # A cell from elsewhere streamed under the name of a model's cell, which stayed in the root.
            raise PrefetchdError(f"units=: ({name!r}, {type(cell).__name__}) names no cell of the model "
                                 f"(a pair is a label and one of the model's cells)")
        resolved.append((name, cell))
    if missing:
        raise PrefetchdError(f"units=: the model has no cell named {', '.join(map(repr, missing))}")
    names = [n for n, _ in resolved]
    if is_compiled(model) and names:
        raise PrefetchdError(
            f"units=: the model's construct is compiled (@jit), so {names[0]!r} and every other cell "
            f"run inside one graph where MindSpore skips their hooks; compile the blocks' constructs "
            f"instead of the model's")
    for n, cell in resolved:
        if is_uncalled(cell):
            raise PrefetchdError(f"units=: {n!r} is a {type(cell).__name__}, which is iterated, never "
                                 f"called, so its hooks never fire; name its items ({n}.0, ...) instead")
        outer = next((o for o in _ancestors(n) if o in by_name and is_compiled(by_name[o])), None)
        if outer is not None:
            raise PrefetchdError(f"units=: {n!r} runs inside the compiled (@jit) construct of {outer!r}, "
                                 f"where MindSpore skips its hooks; name {outer!r} instead")
    for n in names:
        outer = next((o for o in names if o != n and n.startswith(o + ".")), None)
        if outer is not None:
            raise PrefetchdError(f"units=: {n!r} is inside unit {outer!r}; units must not nest")
    if len(set(names)) != len(names):
        raise PrefetchdError("units=: a unit is listed twice")
    return resolved




def _ancestors(name):
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _unique(params):
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
