"""Layer hooks: stream a MindSpore model's weights through the device tier.

    handle = prefetchd.offload(model, daemon, lookahead=2)

plans the model's units (prefetchd.hooks.planner: repeated blocks at any depth,
split to fit the budget, plus a ROOT unit holding every parameter outside the
blocks), refuses at once what can never fit (BudgetError naming the tensor or
unit), drops graphs MindSpore compiled for the model before (they would read
the old storage) and registers every parameter with the daemon
(prefetchd.hooks.registration), and installs forward hooks:

- the model's pre-hook pins the root unit for the whole forward; its
  post-hook releases it behind a compute fence on the output, then prefetches
  the root and the first `lookahead` units for the next pass;
- first forward: records the execution order (the trace), fetching on demand,
  one unit at a time so prefetchd.cost.recording can time each for the cost model;
- afterwards, before a unit runs: prefetch the next `lookahead` units of the
  trace that fit beside what is pinned, then wait for the unit (the wait is
  the stall time), pin and bind it; after its cells ran: fence and unpin, and
  re-issue the lookahead prefetches (one refused for want of a free range
  can be placed now). If the unit's storage moved since it last ran, graphs
  compiled (@jit) for its cells are dropped so they recompile, never stale.

One model runs one pass at a time: a call from a second thread waits in the
model's pre-hook until the running pass ends (its post-hook, or the hook
MindSpore calls when the forward raised). Two interleaved passes would unpin
each other's units while their kernels still read them.

A model streams through one daemon, once: offload() refuses a model (or a
parameter) already offloaded. `close()` removes the hooks; the weights stay in
the daemon's tiers, so the model then refuses to run instead of reading pages
that are not mapped.

A unit that is not resident in time (a *miss*) is fetched on demand, counted
(`stats()["misses"]`, a WARNING the first time per unit) and the run goes on;
`strict=True` raises NotResidentError instead. A unit that is not the one the
trace expects (early exit, skipped layer, other branch) re-synchronises the
trace position and is counted. Hooks do not fire under graph mode, so
offload() refuses it. A pass that runs none of the units (embeddings only)
is fine; the first pass that runs some records the trace.

What offload() and an offloaded model refuse, with the messages, is in
prefetchd.hooks.refusals; the copies of outputs that are views of a unit's weights
(found in the recording pass) in prefetchd.hooks.views.ViewCopies.
"""
import contextlib
import logging
import threading
import time

from . import registration, refusals
from .views import ViewCopies
from ..backend import framework
from ..daemon import Daemon
from ..errors import NotResidentError, PrefetchdError, ShutdownError
from .parts import PartProbes
from .planner import plan_units
from .trace_cursor import ROOT, TraceCursor
from .compiled_later import CompiledLater
from ..cost.estimate import PassEstimator

log = logging.getLogger("prefetchd.hooks")



class Unit:
    """A planned unit at run time: its cells, the daemon records of its parameters, pin state."""
    __slots__ = ("index", "name", "cells", "records", "nbytes", "held", "ran", "params", "compiled",
                 "addresses", "dispatched_ns", "entries", "own_ran", "parted", "part_depth", "last_output")

    def __init__(self, index, planned, records, compiled):
        self.index, self.name = index, planned.name
        self.cells = [cell for _, cell in planned.cells]
        self.records = records
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
        self.last_output = None   # of the last part call (the fence behind them)


class Offloaded:
    """The hooks installed on one model. `close()` removes them (and an owned daemon)."""

    def __init__(self, model, daemon, *, lookahead=None, units=None, auto_fetch=None, tier="remote",
                 checkpoint=None, owns_daemon=False, strict=False, no_split=()):
        ms = framework.mindspore()
        if ms.get_context("mode") == ms.GRAPH_MODE:
            raise PrefetchdError("prefetchd.offload needs PyNative mode: in graph mode MindSpore skips "
                                 "forward hooks and a compiled graph keeps the storage it saw at compile "
                                 "time (call mindspore.set_context(mode=mindspore.PYNATIVE_MODE))")
        daemon._check_open()          # a Daemon never started (or closed) is refused by name
        refusals.refuse_managed(model)
        config = daemon.config
        self.model = model
        self.daemon = daemon
        # "auto": the cost model (prefetchd.cost.model) picks it from the recording pass.
        self._estimator = PassEstimator(daemon, refusals.lookahead_count(lookahead, config, model),
                                        lookahead == "auto")
        self.tier = tier
        self.auto_fetch = config.auto_fetch if auto_fetch is None else bool(auto_fetch)
        self.strict = strict
        self._owns_daemon = owns_daemon
        self._high = daemon.status()["device"]["high_watermark"]
        # Everything that can be refused is refused before anything is registered.
        self._plan = plan_units(model, self._high, self.lookahead, units=units, no_split=no_split,
                                block_bytes=daemon.backend.block_bytes)
        # The refusal's suggested device_budget assumes this daemon's high-watermark fraction.
        self._plan.high_fraction = self._high / config.device_budget
        self._plan.check_fits()
        log.info("prefetchd.offload(%s):\n%s", type(model).__name__, self._plan.format_table())
        registration.drop_compiled_graphs(model)
        params = {id(p): p for u in [self._plan.root, *self._plan.units] for p in u.params}
        records = registration.register(daemon, model, params, tier, checkpoint)
        self.root = Unit(ROOT, self._plan.root, [records[id(p)] for p in self._plan.root.params], [model])
        self.units = [Unit(i, planned, [records[id(p)] for p in planned.params],
                           [c for _, cell in planned.cells for _, c in cell.cells_and_names()])
                      for i, planned in enumerate(self._plan.units)]
        self._by_cell = {id(cell): unit for unit in self.units for cell in unit.cells}
        self._cursor = TraceCursor()   # the recorded order, and where this pass is in it
        self._recording = True
        self._ran = 0                  # unit hooks fired during the current forward
        self.stall_seconds = 0.0
        self.misses = 0
        self._warned = set()           # units whose first miss was logged
        self._session = daemon.compute_session(owner=id(self))   # per-unit calls, this model's trace
        self._pass_lock = threading.Lock()   # held from the model's pre-hook to the end of its pass
        self._pass_thread = None             # the thread holding it
        self.closed = False
        self._handles = []
        for cell in {id(c): c for u in self.units for c in u.cells}.values():
            self._hook_unit_cell(cell)
        # Units whose own cell is never called are pinned from their parts' calls.
        self._parts = PartProbes(self.units, self._by_cell, self._before_part, self._after_part,
                                 skip=self._plan.jit_cells)
        self._parted = []              # units pinned now by a part's call
        def name_of(cell):
            return _cell_name(model, cell)
        # Outputs that are views of their unit's weights, copied before it is released.
        self._views = ViewCopies(name_of)
        self._compiled_later = CompiledLater(model, self.units, self._plan.units, self._parts, name_of)
        self._handles.append(model.register_forward_pre_hook(self._before_model))
        self._handles.append(model.register_forward_hook(self._after_model))
        # always_call: MindSpore runs it when the forward or another hook raised, too.
        self._handles.append(model.register_forward_hook(self._end_pass, always_call=True))
        # Fires before any backward kernel of the model runs (its output's gradient comes first).
        self._handles.append(model.register_backward_pre_hook(self._refuse_backward))

    # ---------------------------------------------------------------- setup
    def _hook_unit_cell(self, cell):
        self._handles.append(cell.register_forward_pre_hook(self._before_unit))
        self._handles.append(cell.register_forward_hook(self._after_unit))

    @property
    def lookahead(self):
        """Units prefetched ahead: the one asked for, or with "auto" the cost model's."""
        return self._estimator.lookahead

    @property
    def estimate(self):
        """The cost model's plan (prefetchd.cost.model.Schedule: pass_seconds, ...) once the recording pass
        ran, refined by the next passes; None without one."""
        return self._estimator.estimate

    def plan(self):
        """The unit plan (prefetchd.hooks.planner.Plan): units, root unit, budget figures."""
        return self._plan

    @contextlib.contextmanager
    def between_passes(self):
        """Hold this model's forwards off (callers on other threads wait) while the block runs;
        refused inside one of its forwards, whose pins and prefetches it would cut across."""
        if self._pass_thread == threading.get_ident():
            raise PrefetchdError("refused inside this model's forward: run it between forwards")
        with self._pass_lock:
            yield

    # ---------------------------------------------------------------- hooks
    def _before_model(self, cell, inputs):
        self._compiled_later.refuse_compiled_holders()
        if self._pass_thread != threading.get_ident():   # (the same thread: a nested call runs through)
            self._pass_lock.acquire()
            self._pass_thread = threading.get_ident()
        self._release_all(None)               # a pass that raised midway left pins behind
        self._compiled_later.drop_probes_under_compiled()
        for unit in self.units:
            unit.part_depth = 0
        self._high = self._session.high_watermark
        self._ran = 0
        self._cursor.start_pass()
        if self._recording:
            self._cursor.steps = [ROOT]
        else:
            self._session.at(0)
        # The root is pinned before the first prefetches: at step 0 its next use after
        # this one looks a whole pass away, so a prefetch queued ahead of its pin could
        # evict it (a miss at every such pass start, seen under load).
        self._acquire(self.root)
        if self._recording:
            self._estimator.recording_started(self._session.marker, self.stall_seconds)
        else:
            self._prefetch_from(1, self.root.nbytes)

    def _after_model(self, cell, inputs, output):
        output = self._views.copied(self.root, cell, output, self._recording)
        self._release_all(_first_tensor(output))
        if self._recording and self._ran == 0 and self.units:
            # A pass that ran none of the units (embeddings only, every block skipped) read
            # none of their weights and has no order to record: the next pass records it.
            # (A compiled model, whose hooks never fire, is all root: it has no units.)
            return output
        if self._recording:
            self._estimator.recorded([self._unit(i) for i in self.trace if i != ROOT], self.root.nbytes,
                                     self._planned_tier(), self.stall_seconds, self._high)
            self._recording = False
            self._adopt_entries()
            self._publish_trace()
        else:
            self._estimator.streamed()
            if self._cursor.end_pass():
                self._publish_trace()
                if self._cursor.retraces == 1:
                    log.info("prefetchd.offload: a pass ran units the trace did not hold (a changed route "
                             "or branch); its order is the trace now (counted in stats()['retraces'])")
        # The next pass starts with the root, then the first units of the trace:
        # the policy sees the pass end (the root is the nearest step, not the farthest).
        self._session.at(len(self.trace) - 1)
        if self.root.records:
            self._session.prefetch(self.root.records, priority=self.lookahead + 1)
        self._prefetch_from(1, self.root.nbytes)
        return output

    def _before_unit(self, cell, inputs):
        unit = self._by_cell[id(cell)]
        self._ran += 1
        if unit.held:                         # another cell of a unit already pinned
            return
        if self._recording:
            unit.own_ran = True
        self._enter(unit, inputs)

    def _enter(self, unit, inputs):
        """Pin `unit` before its first cell (or part) of this step runs."""
        self._release_parted(inputs)
        if self._recording:
            self._cursor.record(unit.index)
        else:
            if not self._cursor.enter(unit.index):
                self._session.resynced()
            self._session.at(self._cursor.position)
            self._prefetch_from(self._cursor.position + 1, self._held_bytes() + unit.nbytes)
        self._acquire(unit)

    def _after_unit(self, cell, inputs, output):
        unit = self._by_cell[id(cell)]
        if not unit.held:
            return None
        unit.ran.add(id(cell))
        last = len(unit.ran) == len(unit.cells)
        # Recording pass: timed to a fence before the view check asks for addresses. That query
        # drains MindSpore's op queue, and a fence after it times the unit's kernels launched
        # from an idle queue: twice their time in a pass (16 Dense(4096, 4096) at batch 8).
        timed = last and self._recording and bool(unit.records) and self._estimator.time_unit(
            self._session.marker, unit.name, _first_tensor(output), unit.dispatched_ns)
        output = self._views.copied(unit, cell, output, self._recording)
        if last:
            self._release(unit, _first_tensor(output), timed=timed)
            if not self._recording:
                # Its memory is free once its kernels ran: a prefetch refused a moment
                # ago for want of a free range can be placed now, before it would miss.
                self._prefetch_from(self._cursor.position + 1, self._held_bytes())
        return output

    # ---------------------------------------------------------------- parts (prefetchd.hooks.parts)
    def _before_part(self, cell, inputs):
        unit = self._parts.entry(cell, self._recording)
        if unit is not None:
            self._ran += 1
            self._enter(unit, inputs)
            unit.parted = True
            self._parted.append(unit)

    def _after_part(self, cell, inputs, output):
        unit = self._parts.unit_of(cell)
        if unit.parted and unit.part_depth == 1:      # an entry: its output leaves the unit
            output = self._views.copied(unit, cell, output, self._recording)
        self._parts.ran(cell, _first_tensor(output), self._recording)
        return output

    def _release_parted(self, inputs):
        """A unit pinned by a part's call (recording pass; later, a part no recorded call
        reached) is done once another unit starts."""
        parted, self._parted = self._parted, []
        for unit in parted:
            if unit.held and unit.parted:
                self._release(unit, unit.last_output if unit.last_output is not None else _first_tensor(inputs))

    def _adopt_entries(self):
        for unit in self._parts.adopt(self.units, self._hook_unit_cell):
            for cell in unit.entries:
                self._by_cell[id(cell)] = unit
            log.info("prefetchd.offload: unit %r%s is pinned from the calls of %s", unit.name,
                     "" if unit.own_ran else " (its own cell never ran)",
                     ", ".join(_cell_name(self.model, c) for c in unit.entries))

    def _end_pass(self, cell, inputs, output):
        if self._pass_thread == threading.get_ident():
            if self._recording:       # _after_model never ran (the forward raised) or ran no unit
                self._estimator.recording_abandoned()
            self._pass_thread = None
            self._pass_lock.release()

    # ---------------------------------------------------------------- pin / release
    def _acquire(self, unit):
        if not unit.records:
            return
        if self._recording or self.auto_fetch or (self.lookahead == 0 and not self.strict):
            # lookahead 0 loads every unit on demand by design: not a miss to warn about
            stall = self._session.acquire(unit.records, auto_fetch=True, unit=unit.name)
        else:
            try:
                stall = self._session.acquire(unit.records, auto_fetch=False, unit=unit.name)
            except NotResidentError as miss:
                self.misses += 1
                if self.strict:
                    raise
                self._note_miss(unit, miss)
                stall = self._session.acquire(unit.records, auto_fetch=True, unit=unit.name)
                if unit is not self.root:     # the prefetches behind it were issued before the miss
                    self._prefetch_from(self._cursor.position + 1, self._held_bytes() + unit.nbytes)
        self.stall_seconds += stall
        unit.held = True
        self._recompile_if_moved(unit)
        unit.ran.clear()
        unit.dispatched_ns = time.monotonic_ns()

    def _recompile_if_moved(self, unit):
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

    def _planned_tier(self):
        """Weights registered remote but all held in host RAM (stage_to_host, or a host cache
        that took everything) are planned as the host tier: no pass reads the disk. (A read
        without the lock: it only picks the plan's tier.)"""
        if all(r.host_valid for u in self.units for r in u.records):
            return "host"
        return self.tier

    def _note_miss(self, unit, miss):
        if unit.name not in self._warned:
            self._warned.add(unit.name)
            log.warning("prefetchd: unit %r was not resident in time (%s); fetched on demand. Later "
                        "misses of this unit are counted in stats()['misses'] only", unit.name, miss)

    def _release(self, unit, dependency, timed=False):
        """Unpin `unit` behind a fence on `dependency`; its compute is timed to that fence
        (prefetchd.cost.estimate) unless `timed` says it was already (PassEstimator.time_unit)."""
        unit.held = False
        unit.parted = False
        unit.ran.clear()
        if not unit.records:
            return
        # A fence behind this unit's kernels lets its memory be reused as soon as
        # they ran, without draining later units' compute.
        epoch = self._session.release(unit.records, dependency, unit=unit.name)
        if not timed:
            # The recording pass waits for the unit's compute (each unit timed alone); while
            # the estimate is refined, later passes are timed by a thread, nothing waits.
            self._estimator.released(unit.name, epoch, None if unit is self.root else unit.dispatched_ns)

    def _release_all(self, dependency):
        for unit in [*self.units, self.root]:
            if unit.held:
                self._release(unit, dependency)

    def _held_bytes(self):
        return sum(u.nbytes for u in [self.root, *self.units] if u.held)

    # ---------------------------------------------------------------- trace
    @property
    def trace(self):
        """The recorded order of one pass: ROOT, then unit indices (prefetchd.hooks.trace_cursor)."""
        return self._cursor.steps

    @property
    def resyncs(self):
        return self._cursor.resyncs

    def _publish_trace(self):
        """Give the daemon's eviction policy the trace (tensor names per step)."""
        self._session.set_trace([[r.name for r in self._unit(i).records] for i in self.trace])

    def _unit(self, step):
        return self.root if step == ROOT else self.units[step]

    def _prefetch_from(self, start, pinned_bytes):
        """Prefetch the next `lookahead` units of the trace from `start` that fit beside the pinned ones."""
        # Never ask for more than fits beside what computes now: a prefetch that
        # evicts the next unit to make room for the one after is thrash.
        room = self._high - pinned_bytes
        ahead = 0
        for index in self._cursor.upcoming(start):
            if ahead >= self.lookahead:
                break
            unit = self.units[index]
            ahead += 1
            if unit.held:
                continue
            room -= unit.nbytes
            if room < 0:
                break
            # Nearer units first: priority falls with distance.
            future = self._session.prefetch(unit.records, priority=self.lookahead - ahead + 1)
            # A refused prefetch (e.g. no free range large enough) shows up as a miss later.
            future.add_done_callback(lambda f, name=unit.name: f.exception() is not None and log.debug(
                "prefetch of %s failed: %s", name, f.exception()))

    # ---------------------------------------------------------------- teardown
    def stats(self):
        """units: planned units (root excluded); trace: steps of one pass (root included);
        misses: units not resident in time (fetched on demand, or raised with strict=True);
        resyncs: units that were not the trace's next step; retraces: passes that ran a unit
        the trace lacked, whose order became the trace."""
        return {"units": len(self.units), "trace": len(self.trace), "resyncs": self.resyncs,
                "retraces": self._cursor.retraces,
                "stall_seconds": self.stall_seconds, "misses": self.misses,
                "root_bytes": self.root.nbytes, "lookahead": self.lookahead,
                "predicted_pass_seconds": self.estimate.pass_seconds if self.estimate else None}

    def close(self):
        """Remove the hooks (and close an owned daemon). The weights stay in the daemon's
        tiers, not in ordinary memory, so the model refuses to run from then on instead
        of reading pages that are not mapped."""
        if self.closed:
            return
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._parts.remove()
        self.closed = True
        self._handles.append(self.model.register_forward_pre_hook(self._refuse_closed))
        try:
            self._release_all(None)
        except ShutdownError:                 # the daemon closed under the model: no pin is left
            pass
        finally:
            self._estimator.close()
            if self._owns_daemon:
                self.daemon.close()

    # ---------------------------------------------------------------- refusals (prefetchd.hooks.refusals)
    def _refuse_backward(self, cell, grad_output):
        raise refusals.backward_refused(self.model)

    def _refuse_closed(self, cell, inputs):
        raise refusals.closed_refused(self.model, self.daemon.config.name)


def _cell_name(model, cell):
    return next((name for name, c in model.cells_and_names() if c is cell), type(cell).__name__)


def _first_tensor(value):
    ms = framework.mindspore()
    if isinstance(value, ms.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for v in value:
            found = _first_tensor(v)
            if found is not None:
                return found
    return None


def offload(model, daemon=None, lookahead=None, units=None, auto_fetch=None, *, tier="remote",
            checkpoint=None, strict=False, no_split=()):
    """Stream `model`'s parameters through `daemon` (a new one from Config.load() if None).

    lookahead / auto_fetch: None takes daemon.config.lookahead / .auto_fetch;
    lookahead="auto" lets the cost model (prefetchd.cost.model) choose it from the
    first pass (logged with the predicted pass time; `handle.estimate`).
    units: explicit units, (name, cell) pairs or cell names (default: planned,
    see prefetchd.hooks.planner); no_split: cell classes never split into children.
    strict: a unit not resident in time raises NotResidentError instead of
    being fetched on demand and counted as a miss.
    tier: where weights live between uses, "remote" (files) or "host" (RAM).
    checkpoint: True if the daemon's store already holds the weights (see
    `prefetchd stage`), or a .ckpt/.safetensors path to stage into it first.
    Either way the model can be built with `no_init_parameters` and never
    hold its weights in RAM.
    Raises BudgetError (nothing registered) if a tensor or unit can never fit.
    """
    owns = daemon is None
    if owns:
        daemon = Daemon().start()
    try:
        handle = Offloaded(model, daemon, lookahead=lookahead, units=units, auto_fetch=auto_fetch,
                           tier=tier, checkpoint=checkpoint, owns_daemon=owns, strict=strict,
                           no_split=no_split)
    except BaseException:
        if owns:
            daemon.close()
        raise
    model._prefetchd = handle
    return handle


def offloaded(daemon=None, lookahead=None, units=None, auto_fetch=None, tier="remote", **options):
    """Class decorator for nn.Cell subclasses: instances are offloaded when constructed.

    daemon may be a callable returning the daemon; options go to offload().
    """
    def wrap(cls):
        original_init = cls.__init__

        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            offload(self, daemon() if callable(daemon) else daemon, lookahead, units, auto_fetch,
                    tier=tier, **options)
        cls.__init__ = __init__
        return cls
    return wrap
