"""An offloaded model's refusal of gradients: a backward pre-hook of its own, through which
the outputs of the model and its units pass while a gradient is recorded, and the output of
a unit or root cell called alone.

A backward would read weights released after their forward (SIGSEGV). MindSpore runs a
backward pre-hook before any backward kernel of what produced the Tensors that passed
through it; the hook raises, MindSpore raises that from the grad call and recovers.

Not Cell.register_backward_pre_hook, for two reasons (MindSpore 2.10,
docs/mindspore-notes.md):
- it passes only a Tensor output, or a tuple output's own Tensors, through the hook: the
  backward of a model returning a dict (mindone's ModelOutput), a list or a nested tuple
  ran unrefused;
- its primitive's C++ side holds a closure over the primitive, which holds the cell: a
  cycle Python's gc cannot see, so the model, its hooks, the handle and the daemon with
  its threads and address-space reservation stayed alive for good.
Our primitive's hook refers to the model's class name only; nothing keeps the model.
"""
import functools

from ..backend import framework
from ..guard import is_managed
from . import refusals
from .outputs import flat_tensors, replaced


class GradientRefusal:
    """The model's own backward pre-hook primitive, and what passes Tensors through it.

    While a gradient is recorded, the output of each of the model's unit cells and the
    model's own output pass through it: any backward reaching a unit's weights comes
    through its output first, however the model's output is built. One with no Tensor to
    pass (None, a plain object, a UserDict: the walk does not enter them) is refused there
    and then. A unit or root cell called alone, outside the model's forward, passes its
    output through it always. A plain forward passes nothing."""

    def __init__(self, model):
        self._name = type(model).__name__
        self._primitive = framework.backward_pre_hook(f"prefetchd:{self._name}",
                                                      functools.partial(_refuse, self._name))

    def forward_hook(self, model, inputs, output):
        """The model's last forward hook."""
        return self._watched(output, "the model") if framework.recording_grad() else None

    def unit_output(self, output, unit_name, alone):
        """The output of a unit's cell (or of a part that enters the unit): passed through
        while a gradient is recorded, and always when the cell was called `alone`."""
        if framework.recording_grad():
            return self._watched(output, f"unit {unit_name!r}")
        return self.exposed(output)[0] if alone else output

    def exposed(self, output):
        """(`output` with its Tensors passed through the hook primitive, rebuilt: containers
        copied, of the same types, a ModelOutput stays one; whether any was passed). A
        Parameter (a weight returned as it is) is not passed: the primitive's output would
        be a second Tensor over its memory, which no guard covers (read after the weight's
        eviction, it kills the process)."""
        tensors = flat_tensors(output)
        positions = [i for i, t in enumerate(tensors) if not (framework.is_parameter(t) or is_managed(t))]
        if not positions:
            return output, False
        passed = self._primitive(tuple(tensors[i] for i in positions))
        passed = list(passed) if isinstance(passed, tuple) else [passed]
        made = iter(passed)
        try:
            rebuilt = replaced(output, positions, lambda tensor: next(made))
        except Exception:       # a container that will not be copied
            return output, False
        # Watched only if every passed Tensor is in the output (a container kept as it was is not).
        found = flat_tensors(rebuilt)
        return rebuilt, len(found) == len(tensors) and all(found[i] is t for i, t in zip(positions, passed))

    def _watched(self, output, what):
        """Under a recorded gradient: `output` passed through, or refused now if it cannot be."""
        output, watched = self.exposed(output)
        if not watched:
            framework.abandon_grad()         # (else PyNative records for good: mindspore-notes.md)
            raise refusals.backward_refused(self._name, unseen=what)
        return output


def _refuse(model_name, grads):
    raise refusals.backward_refused(model_name)
