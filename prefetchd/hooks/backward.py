"""An offloaded model's backward pre-hook, which refuses gradients, and what keeps MindSpore
from holding the model for good because of it.

MindSpore 2.10 keeps a cell that ever had a backward pre-hook alive through a cycle its
C++ side holds (prefetchd.backend.framework.release_backward_pre_hook): the model, its
hooks, the handle and the daemon with its threads and address-space reservation. The
hook is let go of when the handle or its daemon closes. (Registering it only from a
forward recorded for a gradient would avoid the cycle for models never differentiated,
but PyNative's requires_grad() is False in the forward of mindspore.vjp and
ops.GradOperation, which would then run a backward over released weights.)

MindSpore passes through a backward pre-hook only the output itself when it is a Tensor,
or a tuple output's own Tensors. A model returning a dict (mindone's ModelOutput), a list
or a nested tuple had its backward run over released weights (SIGSEGV):
`expose_nested_outputs` passes those Tensors through the same hook.
"""
import functools
import weakref

from ..backend import framework
from ..guard import is_managed
from . import refusals
from .outputs import flat_tensors, replaced


def refuse_backward(handle):
    """Register the model's backward pre-hook, which refuses before any backward kernel of the
    model runs (its output's gradient comes first). Returns the hook's handle."""
    return handle.model.register_backward_pre_hook(functools.partial(refusals.refuse_backward, handle.model))


def expose_nested_outputs(model, inputs, output):
    """A forward hook, registered after the model's others: pass each Tensor of `output` that
    MindSpore's own wrapping misses through the model's backward pre-hook, so a gradient
    through any of them is refused too (under ops.stop_gradient none reaches the hook, and
    nothing is refused). Returns the output rebuilt (containers copied, of the same types:
    a ModelOutput stays one), or None when nothing was missed."""
    if framework.is_tensor(output):
        return None
    tensors = flat_tensors(output)
    positions = _unwrapped(output, tensors)
    if isinstance(output, tuple):
        positions -= _own_positions(output)            # MindSpore passes those through it
    return _exposed(model, output, tensors, positions)


def expose_output(model, output):
    """The output of one of `model`'s units or root cells called alone, outside the model's
    forward, with its Tensors passed through the model's backward pre-hook: the backward of
    that call would read weights released after it (SIGSEGV), and the model's own hook never
    sees it. Returns `output` itself when there is nothing to pass."""
    tensors = flat_tensors(output)
    exposed = _exposed(model, output, tensors, _unwrapped(output, tensors))
    return output if exposed is None else exposed


def _unwrapped(output, tensors):
    """Positions of the Tensors to pass through the hook. Not a Parameter (a weight returned
    as it is): the hook's output would be a second Tensor over its memory, which no guard
    covers (read after the weight's eviction, it kills the process); its gradient runs no
    backward kernel anyway."""
    return {i for i, t in enumerate(tensors) if not (framework.is_parameter(t) or is_managed(t))}


def _own_positions(output):
    """Positions, in flat_tensors(output), of a tuple's own Tensors (as flat_tensors walks)."""
    own, position, seen = set(), 0, {id(output)}
    for item in output:
        if framework.is_tensor(item):
            own.add(position)
        position += len(flat_tensors(item, seen))
    return own


def _exposed(model, output, tensors, positions):
    hook = getattr(model, "_cell_backward_pre_hook", None)
    if hook is None or not positions:
        return None
    wrapped = hook(tuple(tensors[i] for i in sorted(positions)))
    wrapped = iter(wrapped if isinstance(wrapped, tuple) else (wrapped,))
    return replaced(output, positions, lambda tensor: next(wrapped))


def let_go_when_the_daemon_closes(handle):
    """When `handle`'s daemon closes, the model lets go of MindSpore's backward-hook cycle (see
    Offloaded.close), so a model its user drops is collected, and with it the daemon and its
    64 GiB reservation: the README's `with Daemon(...)` never calls handle.close(), and every
    model streamed so was kept for good. Its forward hooks stay (removing them could cut
    across a forward running now); they refuse to run on a closed daemon. Returns the key."""
    attachments = handle.daemon.attachments
    ref = weakref.ref(handle, attachments.forget)     # a collected handle is forgotten

    def let_go():
        h = ref()
        if h is not None and not h.closed:
            h._backward.remove()
            framework.release_backward_pre_hook(h.model)
    attachments.on_close(ref, let_go)
    return ref

