"""Layer decorators: stream a MindSpore model's weights through the device tier.

    handle = prefetchd.offload(model, daemon, lookahead=2)

splits the model into units (each cell of a CellList/SequentialCell, else each
child that holds parameters), registers every parameter with the daemon, and
installs forward hooks on each unit:

- first forward: records the execution order (the trace) while fetching each
  unit on demand;
- afterwards, before a unit runs: wait for its tensors (the wait is the stall
  time), pin and bind them, and prefetch the next `lookahead` units of the
  trace; after it runs: unpin, and let the policy decide what to evict.

A unit that is not the one the trace expects (early exit, skipped layer, other
branch) re-synchronises the trace position at that unit and is counted; the
rest of the run keeps prefetching. Hooks do not fire under `@jit`/graph mode,
so offload() refuses graph mode and the first forward checks that the hooks
ran.
"""
import logging
import time

from .backend import framework
from .daemon import Daemon
from .errors import NotResidentError, PrefetchdError

log = logging.getLogger("prefetchd.hooks")


class Unit:
    __slots__ = ("index", "name", "cell", "records", "nbytes")

    def __init__(self, index, name, cell):
        self.index, self.name, self.cell = index, name, cell
        self.records = []
        self.nbytes = 0


def default_units(model):
    """(name, cell) pairs: cells of CellList/SequentialCell children, else children with parameters."""
    nn = framework.mindspore().nn
    units = []
    for name, child in model.name_cells().items():
        if isinstance(child, (nn.CellList, nn.SequentialCell)):
            units.extend((f"{name}.{sub_name}", sub) for sub_name, sub in child.name_cells().items())
        elif any(True for _ in child.get_parameters()):
            units.append((name, child))
    return units


class Offloaded:
    """The hooks installed on one model. `close()` removes them (and an owned daemon)."""

    def __init__(self, model, daemon, lookahead, units, auto_fetch, tier, checkpoint, owns_daemon):
        ms = framework.mindspore()
        if ms.get_context("mode") == ms.GRAPH_MODE:
            raise PrefetchdError("prefetchd.offload needs PyNative mode: in graph mode MindSpore skips "
                                 "forward hooks and a compiled graph keeps the storage it saw at compile "
                                 "time (call mindspore.set_context(mode=mindspore.PYNATIVE_MODE))")
        self.model = model
        self.daemon = daemon
        self.lookahead = lookahead
        self.auto_fetch = auto_fetch
        self._owns_daemon = owns_daemon
        self.units = [Unit(i, n, c) for i, (n, c) in enumerate(units or default_units(model))]
        if not self.units:
            raise PrefetchdError("offload: the model has no cells holding parameters to offload")
        self._by_cell = {id(u.cell): u for u in self.units}
        self._register(tier, checkpoint)
        self.trace = []                # unit indices in execution order
        self._recording = True
        self._position = 0             # index into trace of the unit about to run
        self._ran = 0                  # unit hooks fired during the current forward
        self.resyncs = 0
        self.stall_seconds = 0.0
        self.misses = 0
        self._pinned = {}              # unit index -> records pinned for its forward
        self._marker = daemon.compute_marker()
        self._handles = []
        for unit in self.units:
            self._handles.append(unit.cell.register_forward_pre_hook(self._before_unit))
            self._handles.append(unit.cell.register_forward_hook(self._after_unit))
        self._handles.append(model.register_forward_pre_hook(self._before_model))
        self._handles.append(model.register_forward_hook(self._after_model))

    # ---------------------------------------------------------------- setup
    def _register(self, tier, checkpoint):
        if checkpoint is not None:
            # Weights come from the store (staged now from a file, or already there).
            self.daemon.register_checkpoint(self.model, checkpoint=None if checkpoint is True else checkpoint)
        registered = {}
        for unit in self.units:
            for p in unit.cell.get_parameters():
                # A weight shared by several units (tied embeddings) is registered
                # once but pinned by every unit that reads it.
                handle = registered.get(id(p))
                if handle is None:
                    handle = registered[id(p)] = self.daemon.handle(p.name) if checkpoint is not None \
                        else self.daemon.register(p, p.name, tier=tier)
                unit.records.append(handle._rec)
                unit.nbytes += handle.nbytes

    # ---------------------------------------------------------------- hooks
    def _before_model(self, cell, inputs):
        self._position = 0
        self._ran = 0

    def _after_model(self, cell, inputs, output):
        if self._ran == 0:
            raise PrefetchdError(
                "prefetchd.offload: the model ran but none of its unit hooks fired — it is compiled "
                "(@jit or graph mode), where MindSpore skips hooks; weights were not streamed")
        if self._recording and self.trace:
            self._recording = False
            self.daemon.set_trace([[r.name for r in self.units[i].records] for i in self.trace], owner=id(self))
        self._prefetch_from(0)   # the next forward pass starts at the top of the trace

    def _before_unit(self, cell, inputs):
        unit = self._by_cell[id(cell)]
        self._ran += 1
        if self._recording:
            self.trace.append(unit.index)
        else:
            self._sync_position(unit)
            self.daemon.advance_trace(self._position, owner=id(self))
            self._prefetch_from(self._position + 1)
        try:
            stall = self.daemon.acquire(unit.records, auto_fetch=self.auto_fetch or self._recording)
        except NotResidentError:
            self.misses += 1      # units refused for a miss (auto_fetch=False)
            raise
        self.stall_seconds += stall
        self._pinned[unit.index] = unit.records

    def _after_unit(self, cell, inputs, output):
        unit = self._by_cell[id(cell)]
        records = self._pinned.pop(unit.index, None)
        if records:
            # A fence behind this unit's kernels lets its memory be reused as
            # soon as they ran, without draining later units' compute.
            dependency = _first_tensor(output)
            if self._marker is not None and dependency is not None:
                self.daemon.compute_done(records, self._marker.mark(dependency))
            self.daemon.unpin(records)
        if not self._recording:
            self._position += 1

    def _sync_position(self, unit):
        """Point the trace position at `unit`; a mismatch re-synchronises and is counted."""
        trace, n = self.trace, len(self.trace)
        if self._position < n and trace[self._position] == unit.index:
            return
        self.resyncs += 1
        self.daemon.note_resync()
        for step in range(1, n + 1):      # nearest occurrence after the current position
            pos = (self._position + step) % n
            if trace[pos] == unit.index:
                self._position = pos
                return
        # A unit the first pass never ran: fetch it on demand; keep the position.
        self.daemon.prefetch(unit.records, priority=1)

    def _prefetch_from(self, start):
        n = len(self.trace)
        if not n:
            return
        # Never ask for more than fits beside the unit computing now: a prefetch
        # that evicts the next unit to make room for the one after is thrash.
        room = self.daemon.status_watermark() - self.units[self.trace[(start - 1) % n]].nbytes
        for k in range(self.lookahead):
            unit = self.units[self.trace[(start + k) % n]]
            room -= unit.nbytes
            if room < 0:
                break
            # Nearer units first: priority falls with distance.
            future = self.daemon.prefetch(unit.records, priority=self.lookahead - k)
            if future.done() and future.exception() is not None:
                log.debug("prefetch of %s failed: %s", unit.name, future.exception())

    # ---------------------------------------------------------------- teardown
    def stats(self):
        return {"units": len(self.units), "trace": len(self.trace), "resyncs": self.resyncs,
                "stall_seconds": self.stall_seconds, "misses": self.misses}

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._owns_daemon:
            self.daemon.close()


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


def offload(model, daemon=None, lookahead=2, units=None, auto_fetch=False, *, tier="remote",
            checkpoint=None):
    """Stream `model`'s parameters through `daemon` (a new one from Config.load() if None).

    tier: where weights live between uses, "remote" (files) or "host" (RAM).
    checkpoint: True if the daemon's store already holds the weights (see
    `prefetchd stage`), or a .ckpt/.safetensors path to stage into it first.
    Either way the model can be built with `no_init_parameters` and never
    hold its weights in RAM.
    """
    owns = daemon is None
    if owns:
        daemon = Daemon().start()
    handle = Offloaded(model, daemon, lookahead, units, auto_fetch, tier, checkpoint, owns)
    model._prefetchd = handle
    return handle


def offloaded(daemon=None, lookahead=2, units=None, auto_fetch=False, tier="remote"):
    """Class decorator for nn.Cell subclasses: instances are offloaded when constructed."""
    def wrap(cls):
        original_init = cls.__init__

        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            offload(self, daemon() if callable(daemon) else daemon, lookahead, units, auto_fetch, tier=tier)
        cls.__init__ = __init__
        return cls
    return wrap
