"""An offloaded model's backward pre-hook, which refuses gradients, and what keeps MindSpore
from holding the model for good because of it.

MindSpore 2.10 keeps a cell that ever had a backward pre-hook alive through a cycle its
C++ side holds (prefetchd.backend.framework.release_backward_pre_hook): the model, its
hooks, the handle and the daemon with its threads and address-space reservation. The
hook is let go of when the handle or its daemon closes. (Registering it only from a
forward recorded for a gradient would avoid the cycle for models never differentiated,
but PyNative's requires_grad() is False in the forward of mindspore.vjp and
ops.GradOperation, which would then run a backward over released weights.)
"""
import functools
import weakref

from ..backend import framework
from . import refusals


def refuse_backward(handle):
    """Register the model's backward pre-hook, which refuses before any backward kernel of the
    model runs (its output's gradient comes first). Returns the hook's handle."""
    return handle.model.register_backward_pre_hook(functools.partial(refusals.refuse_backward, handle.model))


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

