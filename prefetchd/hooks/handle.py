"""The handle offload() returns: the hooks installed on one model, its pins, and close().

prefetchd.hooks.offload describes what the hooks do over a pass. This module builds the
handle (plan, registration, hooks) and holds the units' and parts' hooks; the model's own
hooks, where a pass begins and ends, are the PassBoundaries mixin (pass_boundaries.py), and
what the handle reports is the HandleReadings mixin (handle_readings.py).
"""
import functools
import logging

from . import backward, graph_mode, registration, refusals, reload
from ..backend import framework
from ..errors import PrefetchdError, ShutdownError
from ..cost.estimate import PassEstimator
from .budget_hint import DEFAULT_HIGH_FRACTION
from .compiled_later import CompiledLater
from .handle_readings import HandleReadings
from .outer_calls import OuterCalls, outer_cells
from .parts import PartProbes
from .pass_boundaries import PassBoundaries
from .pass_turn import PassTurn
from .replaced import ReplacedParams
from .passes import RecordingPass, StreamingPass
from .root_calls import hook_root_cells
from .planner import fitting_plan
from .trace_cursor import ROOT, TraceCursor
from .units import Pins, Unit, cell_name, first_tensor, hook_unit_cell
from .views import ViewCopies

log = logging.getLogger("prefetchd.hooks")


class Offloaded(refusals.NotCopyable, PassBoundaries, HandleReadings):
    """The hooks installed on one model. `close()` removes them (and an owned daemon).

    The hooks hand each step to the current pass (prefetchd.hooks.passes): the recording
    pass until one pass ran a unit, then the streaming pass. Pins (prefetchd.hooks.units)
    hold units on the device while their cells compute. Where a pass begins and ends is
    PassBoundaries' (pass_boundaries.py).
    """

    def __init__(self, model, daemon, *, lookahead=None, units=None, auto_fetch=None, tier="remote",
                 checkpoint=None, owns_daemon=False, strict=False, no_split=()):
        ms = framework.mindspore()
        if ms.get_context("mode") == ms.GRAPH_MODE:
            raise PrefetchdError("prefetchd.offload needs PyNative mode: in graph mode MindSpore skips "
                                 "forward hooks and a compiled graph keeps the storage it saw at compile "
                                 "time (call mindspore.set_context(mode=mindspore.PYNATIVE_MODE))")
        if tier not in ("remote", "host"):
            raise ValueError(f"prefetchd.offload: tier must be 'remote' (files) or 'host' (RAM), "
                             f"not {tier!r}")
        daemon.check_open()           # a Daemon never started (or closed) is refused by name
        refusals.refuse_managed(model)
        refusals.warn_unlisted_cells(model)
        config = daemon.config
        self.model, self.daemon, self.tier, self.strict = model, daemon, tier, strict
        # "auto": the cost model (prefetchd.cost.model) picks it from the recording pass.
        self._estimator = PassEstimator(daemon, refusals.lookahead_count(lookahead, config, model),
                                        lookahead == "auto")
        self.auto_fetch = config.auto_fetch if auto_fetch is None else bool(auto_fetch)
        self._owns_daemon = owns_daemon
        self._high = daemon.status()["device"]["high_watermark"]
        # Everything that can be refused is refused before anything is registered. The refusal's
        # suggested device_budget assumes this daemon's high-watermark fraction: the default's
        # own where it is the default (the ratio of int(budget * 0.95) to the budget is a hair
        # under 0.95, and named a budget a byte too high).
        fraction = (None if self._high == int(config.device_budget * DEFAULT_HIGH_FRACTION)
                    else self._high / config.device_budget)
        self._plan, self._estimator.lookahead = fitting_plan(
            model, self._high, self.lookahead, auto=self._estimator.auto, high_fraction=fraction,
            units=units, no_split=no_split, block_bytes=daemon.backend.block_bytes)
        log.info("prefetchd.offload(%s):\n%s", type(model).__name__, self._plan.format_table())
        self._register(checkpoint)
        self._session = daemon.compute_session(owner=id(self))   # per-unit calls, this model's trace
        self._cursor = TraceCursor()   # the recorded order, and where this pass is in it
        self._pins = Pins(self._session, self._estimator, self.root, self.units, strict=strict)
        self._streaming = StreamingPass(self._cursor, self._session, self._pins, self._estimator,
                                        lambda: self.lookahead, lambda: self._high, auto_fetch=self.auto_fetch,
                                        publish=self._publish_trace)
        self._pass = RecordingPass(self._cursor, self._session, self._pins, self._estimator,
                                   lambda: _planned_tier(self.units, self.tier))
        self._ran = 0                  # unit hooks fired during the current forward
        self.turn = PassTurn(model, self._abandon_pass)   # one thread's pass at a time
        self.closed = self._given_back = False
        self._install_hooks()
        self.half_loaded = reload.after_crash(self, model, checkpoint)   # a load cut short: passes refused
        self._dropped = registration.forget_when_dropped(self, [self.root, *self.units])

    def _register(self, checkpoint):
        registration.drop_compiled_graphs(self.model)
        plan = self._plan
        params = {id(p): p for u in [plan.root, *plan.units] for p in u.params}
        records = registration.register(self.daemon, self.model, params, self.tier, checkpoint)
        self.root = Unit(ROOT, plan.root, [records[id(p)] for p in plan.root.params], [self.model])
        self.units = [Unit(i, planned, [records[id(p)] for p in planned.params],
                           [c for _, cell in planned.cells for _, c in cell.cells_and_names()])
                      for i, planned in enumerate(plan.units)]
        self._by_cell = {id(cell): unit for unit in self.units for cell in unit.cells}
        self._replaced = ReplacedParams(self.model, params.values())

    def _install_hooks(self):
        model = self.model
        self._handles = []
        self._refusal = backward.GradientRefusal(model)    # of gradients through the model
        for cell in {id(c): c for u in self.units for c in u.cells}.values():
            self._hook_unit_cell(cell)
        # Units whose own cell is never called are pinned from their parts' calls.
        self._parts = PartProbes(self.units, self._by_cell, self._before_part, self._after_part,
                                 skip=self._plan.jit_cells)

        def name_of(cell):
            return cell_name(model, cell)
        # Outputs that are views of their unit's weights, copied before it is released.
        self._views = ViewCopies(name_of)
        self._compiled_later = CompiledLater(model, self.units, self._plan.units, self._parts, name_of)
        self._handles.append(model.register_forward_pre_hook(self._before_model))
        outer = OuterCalls(self.turn, self._begin_pass, lambda cell, output: self._refusal.exposed(
            self._finish_pass(cell, output))[0], self._end_pass)
        unit_cells = [c for u in self.units for c in u.cells]
        self._handles += outer.install(outer_cells(model, unit_cells, self._plan.jit_cells))
        self._handles += hook_root_cells(model, self.root.records, self._session, self.turn, self._refusal,
                                         skip=self._plan.jit_cells)
        self._handles.append(model.register_forward_hook(self._after_model))
        # always_call: MindSpore runs it when the forward or another hook raised, too.
        self._handles.append(model.register_forward_hook(self._end_pass, always_call=True))
        self._handles.append(model.register_forward_hook(self._refusal.forward_hook))    # the last one
        graph_mode.refuse_graph_calls(model)

    def _hook_unit_cell(self, cell):
        self._handles += hook_unit_cell(cell, self._before_unit, self._after_unit)

    # ---------------------------------------------------------------- the units' hooks
    def _before_unit(self, cell, inputs):
        unit = _unit_of(self._by_cell, cell)
        if not unit.held and self._parts.called_inside_another(cell):
            return                            # a shared cell, inside a unit that holds it
        self._ran += 1
        unit.running += 1
        if unit.held:                         # another cell of a unit already pinned
            return
        if self._pass.recording:
            unit.own_ran = True
        self._enter(unit, inputs)
        if any(entry is cell for entry in unit.entries):
            # Pinned by an entry (a part's call, adopted after the recording pass): done
            # once another unit starts, as the recording pass pinned it (_before_part). Kept
            # while it fits, it kept out the next unit's prefetch, and the recorded pin that
            # followed it never came (a miss or resync on every pass).
            unit.parted = True
            self._pins.idle(unit)

    def _enter(self, unit, inputs):
        """Pin `unit` before its first cell (or part) of this step runs."""
        self._pins.release_idle(unit, inputs, self._high)
        self._pass.enter(unit)

    def _after_unit(self, cell, inputs, output):
        unit = _unit_of(self._by_cell, cell)
        unit.running = max(0, unit.running - 1)
        if not unit.held:
            return None
        unit.ran.add(id(cell))
        last = len(unit.ran) == len(unit.cells)
        timed = last and self._pass.timed(unit, first_tensor(output))
        output = self._views.copied(unit, cell, output, self._pass.recording)
        if last:
            self._pins.release(unit, first_tensor(output), timed=timed)
            self._pass.after_release()
        elif not unit.running:
            # Not all its cells ran (an entry called alone later in the pass, siblings another
            # unit's cells run between): idle, given up for a unit that needs its room.
            unit.last_output = first_tensor(output)
            self._pins.idle(unit)
        return self._refusal.unit_output(output, unit.name, alone=not self.turn.held_here())

    # ---------------------------------------------------------------- parts (prefetchd.hooks.parts)
    def _before_part(self, cell, inputs):
        unit = self._parts.entry(cell, self._pass.recording)
        if unit is not None:
            self._ran += 1
            self._enter(unit, inputs)
            unit.parted = True
            self._pins.idle(unit)

    def _after_part(self, cell, inputs, output):
        unit = self._parts.unit_of(cell)
        if unit.parted and unit.part_depth == 1:      # an entry: its output leaves the unit
            output = self._refusal.unit_output(self._views.copied(unit, cell, output, self._pass.recording),
                                               unit.name, alone=not self.turn.held_here())
        self._parts.ran(cell, first_tensor(output), self._pass.recording)
        return output

    def _adopt_entries(self):
        for unit in self._parts.adopt(self.units, self._hook_unit_cell):
            for cell in unit.entries:
                self._by_cell[id(cell)] = unit
            log.info("prefetchd.offload: unit %r%s is pinned from the calls of %s", unit.name,
                     "" if unit.own_ran else " (its own cell never ran)",
                     ", ".join(cell_name(self.model, c) for c in unit.entries))

    # ---------------------------------------------------------------- trace
    def _publish_trace(self):
        """Give the daemon's eviction policy the trace (tensor names per step)."""
        self._session.set_trace([[r.name for r in (self.root if i == ROOT else self.units[i]).records]
                                 for i in self.trace])

    def hook_handles(self):
        """Every hook this offload put on the model's cells (jit_calls hides them from a graph)."""
        return [*self._handles, *self._parts.handles()]

    # ---------------------------------------------------------------- teardown and refusals
    def close(self):
        """Wait for another thread's forward to end (refused inside this model's own), remove the hooks,
        give the weights back to the daemon (memory, the store files it wrote), close an owned daemon; the
        model refuses to run from then on. Called again, it gives back what was still pinned the first time."""
        if self.closed:
            self._given_back = self._given_back or registration.unregister(self.daemon, [self.root, *self.units])
            return
        with self.turn.held():              # no pass of this model runs while its hooks go
            self._dropped.detach()        # given back here
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._parts.remove()
            self.closed = True
            self._handles.append(self.model.register_forward_pre_hook(
                functools.partial(refusals.refuse_closed, self.model, self.daemon.config.name)))
            try:
                self._pins.release_all(None)      # a pass cut short by Ctrl-C left its pins
                self._given_back = registration.unregister(self.daemon, [self.root, *self.units])
            except ShutdownError:                 # the daemon closed under the model: no pin is left
                pass
            finally:
                self._estimator.close()
                if self._owns_daemon:
                    self.daemon.close()


def _planned_tier(units, tier):
    """Weights registered remote but all held in host RAM (stage_to_host, or a host cache
    that took everything) are planned as the host tier: no pass reads the disk. (A read
    without the lock: it only picks the plan's tier.)"""
    return "host" if all(r.host_valid for u in units for r in u.records) else tier


def _unit_of(by_cell, cell):
    """The unit of a hooked cell. A cell copied with its hooks after offload() (MindSpore's
    auto_mixed_precision rebuilds cells) is none of them: said so, not a KeyError."""
    unit = by_cell.get(id(cell))
    if unit is None:
        raise PrefetchdError(f"prefetchd: a {type(cell).__name__} carrying this model's hooks is not one of "
                             f"the cells offload() planned: the model's cells were copied or replaced "
                             f"after offload() (e.g. by mindspore.amp.auto_mixed_precision); change the "
                             f"model before offload()")
    return unit
