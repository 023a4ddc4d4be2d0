"""Units at run time and their pins: what a pass of an offloaded model holds on the device.

A `Unit` is a planned unit (prefetchd.hooks.planner) bound to the daemon records of its
parameters. `Pins` pins and releases units through the model's compute session, counting
the time compute waited (stall) and the units that were not resident in time (misses).
"""
import logging
import time

from ..backend import framework
from ..errors import BudgetError, NotResidentError
from .budget_hint import budget_for_high_watermark
from .interrupts import sigint_deferred

log = logging.getLogger("prefetchd.hooks")


def hook_unit_cell(cell, before, after):
    """Install a unit's pin (`before`, a forward pre-hook) and release (`after`, a forward
    hook) on one of its cells; their handles. A user's own hooks on the cell may read its
    weights (weight-norm logging, an observer), so the pin runs before every pre-hook of the
    cell (prepend) and the release after every hook, one registered after offload() too
    (moved back behind it at each call). `after` runs when the cell raises, too (always_call):
    a unit whose raise the model caught stayed pinned for the rest of the pass, and a later
    unit found no room."""
    release = None

    def pin(cell, inputs):
        framework.keep_forward_hook_last(cell, release)
        return before(cell, inputs)

    handles = [cell.register_forward_pre_hook(pin, prepend=True)]
    release = cell.register_forward_hook(after, always_call=True)
    return handles + [release]


class Unit:
    """A planned unit at run time: its cells, the daemon records of its parameters, pin state."""
    __slots__ = ("index", "name", "cells", "records", "nbytes", "held", "ran", "params", "compiled",
                 "addresses", "dispatched_ns", "entries", "own_ran", "parted", "part_depth", "last_output", "running")

    def __init__(self, index, planned, records, compiled):
        self.index, self.name = index, planned.name
        self.cells = [cell for _, cell in planned.cells]
        # Each record once: the session submits these as they are (a pin counts its tensors).
        self.records = tuple({id(r): r for r in records}.values())
        self.nbytes = planned.nbytes
        self.held = False
        self.ran = set()          # ids of its cells that finished since it was pinned
        self.params = planned.params
        self.compiled = compiled  # cells whose compiled graphs would read these parameters
        self.addresses = None     # the parameters' storage when they were last bound
        self.dispatched_ns = 0    # recording pass: when its kernels started to be dispatched
        # Calls of its parts (prefetchd.hooks.parts), recording pass:
        self.entries = []         # parts that ran while no cell of the unit ran
        self.own_ran = False      # a cell of its own ran
        self.parted = False       # pinned now by an entry
        self.part_depth = 0       # part calls running now
        self.last_output = None   # of its last call while pinned (the fence if released idle)
        self.running = 0          # calls of its own cells running now (nested ones too)


class Pins:
    """Pin and release units through `session` (core.session.ComputeSession).

    A unit is pinned before its first cell runs and released behind a compute fence on its
    output, so its memory is reused only once its kernels ran. `estimator` times each
    release (prefetchd.cost.estimate.PassEstimator).
    """

    def __init__(self, session, estimator, root, units, *, strict):
        self.session, self.estimator = session, estimator
        self.root, self.units = root, units
        self.strict = strict
        self.stall_seconds = 0.0
        self.misses = 0
        self._warned = set()           # units whose first miss was logged
        self._idle = []                # pinned, and none of their cells runs now (release_idle)

    def acquire(self, unit, *, auto_fetch, after_miss=None):
        """Pin `unit`, fetching it on demand if `auto_fetch`; otherwise a unit not resident is a
        miss (raised with strict=True, else counted, fetched, then `after_miss()`)."""
        if not unit.records:
            return
        # A Ctrl-C while waiting for the pin: it lands without us, and the session unpins it
        # (core/session.py); `held` is set the moment it returns, for release_all.
        try:
            stall = self._acquire(unit, auto_fetch, after_miss)
        except BudgetError as e:
            raise self._held_together(unit, e) from None
        self.stall_seconds += stall
        _recompile_if_moved(unit)
        unit.ran.clear()
        unit.dispatched_ns = time.monotonic_ns()

    def _acquire(self, unit, auto_fetch, after_miss):
        """Pin unit's records (see acquire); its stall seconds."""
        if auto_fetch:
            stall = self.session.acquire(unit.records, auto_fetch=True, unit=unit.name)
        else:
            try:
                stall = self.session.acquire(unit.records, auto_fetch=False, unit=unit.name)
            except NotResidentError as miss:
                self.misses += 1
                if self.strict:
                    raise NotResidentError(miss.name, miss.tier, miss.state, (
                        f"prefetchd.offload(strict=True): unit {unit.name!r} was not prefetched in time "
                        f"({miss}). A pass that leaves the recorded order (a skipped or new unit) raises "
                        f"at the first unit out of order; an order that lasts becomes the trace once two "
                        f"passes ran alike. strict=False fetches it on demand and counts a miss")) from None
                self._note_miss(unit, miss)
                stall = self.session.acquire(unit.records, auto_fetch=True, unit=unit.name)
                unit.held = True
                if after_miss is not None and unit is not self.root:
                    after_miss()
        unit.held = True
        return stall

    def release(self, unit, dependency, timed=False):
        """Unpin `unit` behind a fence on `dependency`; its compute is timed to that fence
        (prefetchd.cost.estimate) unless `timed` says it was already (PassEstimator.time_unit)."""
        unit.parted = False
        unit.ran.clear()
        unit.last_output = None   # a fence from this pin only: an older output fences too little
        if not unit.records:
            unit.held = False
            return
        # A fence behind this unit's kernels lets its memory be reused as soon as
        # they ran, without draining later units' compute. (The unpin and `held` together.)
        with sigint_deferred():
            unit.held = False
            epoch = self.session.release(unit.records, dependency, unit=unit.name)
        if not timed:
            # The recording pass waits for the unit's compute (each unit timed alone); while
            # the estimate is refined, later passes are timed by a thread, nothing waits.
            self.estimator.released(unit.name, epoch, None if unit is self.root else unit.dispatched_ns)

    def release_all(self, dependency):
        self._idle.clear()
        for unit in [*self.units, self.root]:
            if unit.held:
                self.release(unit, dependency)

    def idle(self, unit):
        """`unit` is pinned and none of its cells runs now: release_idle decides when it goes.
        Its last output (`unit.last_output`) is the fence behind its compute, if set."""
        if unit not in self._idle:
            self._idle.append(unit)

    def release_idle(self, entering, inputs, high):
        """Before `entering` is pinned: release the idle units. One pinned by a part's call
        (recording pass; later, a part no recorded call reached) is done once another unit
        starts. One whose cells ran only in part (an entry called alone again after its
        block, siblings another unit's cells run between) goes only if `entering` would
        not fit beside it under `high`: else it stayed pinned to the pass end and every
        pass failed with BudgetError, while interleaved units that fit keep their pins (no
        reload, the recorded order kept). One running again (`entering` is nested in a
        call of it) is not idle: the end of its call lists it again. `inputs`: those of
        `entering`, the fence behind a unit with no output of its own this pin. (Called
        before every unit: nothing is summed while no unit is idle.)"""
        if not self._idle:
            return
        fits = self.held_bytes() + entering.nbytes <= high
        idle, self._idle = self._idle, []
        for unit in idle:
            if not unit.held or unit.running:
                continue
            if unit.parted or not fits:
                self.release(unit, unit.last_output if unit.last_output is not None else first_tensor(inputs))
            else:
                self._idle.append(unit)

    def _held_together(self, unit, error):
        """`error` (a pin of `unit` refused) with its cause where the units pinned beside it
        leave no room: a unit called inside another (units= blocks whose code calls one
        another) needs both at once, which offload()'s fit rule, one unit at a time, cannot
        see before the calls happen."""
        held = [u for u in [self.root, *self.units] if u.held and u is not unit and u.nbytes]
        high = self.session.high_watermark
        together = sum(u.nbytes for u in held) + unit.nbytes
        if not held or together <= high:
            return error
        names = ", ".join(f"{u.name!r} ({u.nbytes} bytes)" for u in held)
        them, ends = ("it", "its call ended") if len(held) == 1 else ("them", "their calls ended")
        return BudgetError(
            f"{error}. Unit {unit.name!r} ({unit.nbytes} bytes) was needed while {names} stayed "
            f"pinned (it is called inside {them}, or before {ends}): {together} bytes "
            f"together, above the high watermark {high}. Raise device_budget (to at least "
            f"{budget_for_high_watermark(together)} bytes at the default 95% watermark), or give units= "
            f"that the model does not call inside one another (offload() without units= splits them)")

    def held_bytes(self):
        return sum(u.nbytes for u in [self.root, *self.units] if u.held)

    def _note_miss(self, unit, miss):
        if unit.name not in self._warned:
            self._warned.add(unit.name)
            log.warning("prefetchd: unit %r was not resident in time (%s); fetched on demand. Later "
                        "misses of this unit are counted in stats()['misses'] only", unit.name, miss)


def _recompile_if_moved(unit):
    """A graph compiled (@jit) while the unit's parameters lived elsewhere must not run:
    when their storage moved since they were last bound, drop the graphs of the unit's
    cells so the call about to run recompiles against the current storage (correct,
    slow; with stable addresses the storage never moves and nothing recompiles).
    The addresses are the daemon's own record of where it bound each tensor:
    asking MindSpore (Tensor.data_ptr) waits for its whole op queue to drain."""
    addresses = tuple(rec.bound_address for rec in unit.records)
    if unit.addresses is not None and addresses != unit.addresses:
        for cell in unit.compiled:
            framework.invalidate_compiled(cell)
    unit.addresses = addresses


def cell_name(model, cell):
    return next((name for name, c in model.cells_and_names() if c is cell), type(cell).__name__)


def first_tensor(value):
    ms = framework.mindspore()
    if isinstance(value, ms.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            found = first_tensor(v)
            if found is not None:
                return found
    return None
