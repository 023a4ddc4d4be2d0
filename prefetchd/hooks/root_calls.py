"""Root cells called on their own, outside the model's forward.

The root unit (the embeddings, a tied head, final norms) is pinned by the model's
pre-hook for the length of a pass. A cell holding root weights can also be called
alone, between passes: `e = model.get_input_embeddings()(ids)` and then
`model(inputs_embeds=e)` is how prompt tuning and multimodal models feed a
language model. There nothing pinned its weights, and every such call was refused
("not resident ... outside an offloaded model's forward"). A called block is a
unit whose hooks fetch it on demand; a root cell gets the same: outside a pass its
own root weights are pinned (fetched if need be) for its call and released behind
a compute fence on its output. Inside a pass of the model the root is pinned
already and these hooks do nothing. The output of a call alone passes through
the model's gradient refusal (prefetchd/hooks/backward.py): a gradient through it
is refused, as through the model.
"""
import threading

from .construct_reads import is_jit
from .units import first_tensor


def hook_root_cells(model, root_records, session, turn, refusal, skip=()):
    """Hook every cell of `model` that owns root weights (not the model itself, nor a cell
    that runs inside a compiled graph: under a @jit construct, or in `skip`, the cells a
    @jit method calls, where a hook cannot run); returns the hook handles."""
    by_param = {id(rec.target): rec for rec in root_records if rec.target is not None}
    handles = []
    for name, cell in _hookable(model, skip):
        records = [by_param[id(p)] for p in cell._params.values() if p is not None and id(p) in by_param]
        if records:
            call = _RootCellCall(refusal, records, session, turn, f"root:{name}")
            handles.append(cell.register_forward_pre_hook(call.before))
            handles.append(cell.register_forward_hook(call.after, always_call=True))
    return handles


def _hookable(model, skip):
    found, seen = [], {id(model)}

    def walk(cell, prefix):
        if is_jit(cell.construct):              # what it calls runs inside its graph
            return
        for name, child in cell.name_cells().items():
            if child is None or id(child) in seen or id(child) in skip:
                continue
            seen.add(id(child))
            found.append((prefix + name, child))
            walk(child, prefix + name + ".")
    walk(model, "")
    return found


class _RootCellCall:
    """The hooks of one root cell: pin its root weights for a call made outside a pass."""

    def __init__(self, refusal, records, session, turn, name):
        self._refusal, self._records, self._session, self._turn, self._name = refusal, records, session, turn, name
        self._held = threading.local()      # per thread: how many of its calls pinned them

    def before(self, cell, inputs):
        if self._turn.held_here():
            return                          # inside the model's pass: the root is pinned
        self._session.acquire(self._records, auto_fetch=True, unit=self._name)
        self._held.depth = getattr(self._held, "depth", 0) + 1

    def after(self, cell, inputs, output):
        if getattr(self._held, "depth", 0) > 0:
            self._held.depth -= 1
            self._session.release(self._records, first_tensor(output), unit=self._name)
            return self._refusal.exposed(output)[0]
        return None
