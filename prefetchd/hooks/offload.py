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
parameter) already offloaded. `close()` removes the hooks and gives the weights
back to the daemon (Daemon.unregister); the model then refuses to run.

A unit that is not resident in time (a *miss*) is fetched on demand, counted
(`stats()["misses"]`, a WARNING the first time per unit) and the run goes on;
`strict=True` raises NotResidentError instead. A unit that is not the one the
trace expects (early exit, skipped layer, other branch) re-synchronises the
trace position and is counted. Hooks do not fire under graph mode, so
offload() refuses it. A pass that runs none of the units (embeddings only)
is fine; the first pass that runs some records the trace.

What offload() and an offloaded model refuse, with the messages, is in prefetchd.hooks.refusals;
the copies of outputs that are views of a unit's weights (found when recording) in views.ViewCopies;
the handle itself (hooks, pins, close) in prefetchd.hooks.handle, its pass boundaries in
prefetchd.hooks.pass_boundaries.
"""
import os

from .. import sigint
from ..daemon import Daemon
from . import jit_calls
from .handle import Offloaded


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
    if checkpoint is False:                # (read as a path, it was "unknown checkpoint format")
        checkpoint = None
    elif checkpoint is not None and checkpoint is not True and not isinstance(checkpoint, (str, os.PathLike)):
        raise TypeError(f"prefetchd.offload: checkpoint must be None, True (the daemon's store holds the "
                        f"weights) or a .ckpt/.safetensors path, not {checkpoint!r}")
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
    jit_calls.watch(model, handle)
    sigint.keep_keyboard_interrupt()         # (registering ran MindSpore ops, maybe its first)
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
