"""What offload() does to a MindSpore model: plan its units, hook its cells, stream its weights.

Modules, by role (imports point down this list, never up):

    offload          offload() / @offloaded: the arguments checked, the handle made
    handle           the Offloaded handle: plan, registration, the units' hooks, close
    pass_boundaries  where a pass begins and ends: the model's own hooks
    handle_readings  what the handle tells its user: plan, trace, stats()
    reload           load_param_into_net: new values for an offloaded model, between its passes
    replaced         Parameters the model replaced after offload(), said once
    registration     the planned parameters handed to the daemon, once; register_checkpoint
    passes           the recording pass and the streamed passes the hooks drive
    pass_turn        whose turn it is to run a pass (one thread at a time)
    outer_calls      cells between the model and its units called alone: a pass of their own
    root_calls       root cells called alone, outside the model's forward
    jit_calls        mindspore.jit(cell)(x) on a cell of an offloaded model, outside its forward
    graph_mode       a model called in graph mode after offload(), refused by name
    backward         the backward pre-hook that refuses gradients, and the Tensors it sees
    units            units at run time and their pins
    interrupts       Ctrl-C held off for the lines that must run together
    refusals         what offload() and an offloaded model refuse, and the messages
    compiled_later   cells compiled with mindspore.jit after offload()
    views            outputs that are views of a unit's weights, copied while it is pinned
    outputs          a cell's output walked: its Tensors in order, rebuilt with some replaced
    parts            probes on units' parts (a unit called only through its parts)
    trace_cursor     the recorded order and where a pass is in it (no I/O)
    planner          the unit plan from the cell tree (no daemon, no side effects)
    unit_search      the candidate units, before the root is settled
    plan_fit         whether a plan's units fit under the high watermark, and what never can
    budget_hint      the smallest device_budget a refused plan would fit under
    jit_graphs       cells a @jit method's graph runs (never units)
    construct_reads  the weight reads a construct's source makes

The rules the planner follows are described once, in docs/offload.md.
"""
from .offload import Offloaded, offload, offloaded
from .registration import register_checkpoint
from .reload import load_param_into_net

__all__ = ["Offloaded", "offload", "offloaded", "load_param_into_net", "register_checkpoint"]
