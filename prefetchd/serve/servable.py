"""What a worker serves: a Servable, its input signature, and how a factory's
result becomes one.

A `--model module:function` factory returns either

- `(cell, signature)`: a mindspore.nn.Cell run as `cell(*inputs)`, and one entry
  per positional input: a TensorSpec, a dict with TensorSpec's fields, or the
  older `(shape, dtype name[, high])` tuple whose first dimension is the batch
  axis and whose other dimensions are fixed;
- a servable object: `cell` (the nn.Cell whose parameters are offloaded),
  `inputs` (its signature), `forward(*batched arrays) -> array or tuple`, and
  optionally `generate(input_ids, max_new_tokens) -> new token ids (batch, n)`;
- a generation-capable cell (HF-style causal LM, e.g. mindone's LlamaForCausalLM):
  adapted by prefetchd.serve.causal_lm.

Outputs are split back along the inputs' batch axis (axis 0 when no input has
one); a servable object's `output_batch_axis` may say otherwise, and is required
where the inputs batch along different axes (a guess there could hand a request
another request's rows).
"""
from dataclasses import dataclass, field

import numpy as np

from ..config import ConfigError
from .causal_lm import CausalLMServable
from .tensor_spec import as_tensor_spec


class CellServable:
    """A cell and its signature: forward runs `cell(*inputs)`."""

    def __init__(self, cell, inputs, where):
        self.cell = cell
        self.inputs = [as_tensor_spec(e, i) for i, e in enumerate(inputs)]
        self.output_batch_axis = _inputs_batch_axis(self.inputs, where)

    def forward(self, *arrays):
        import mindspore as ms
        return self.cell(*[ms.Tensor(a) for a in arrays])


def as_servable(made, where):
    """The Servable of a factory's result; ConfigError saying what it should be."""
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], (list, tuple)):
        return CellServable(*made, where)
    if callable(getattr(made, "forward", None)) and hasattr(made, "inputs") \
            and hasattr(made, "cell"):
        made.inputs = [as_tensor_spec(e, i) for i, e in enumerate(made.inputs)]
        if getattr(made, "output_batch_axis", None) is None:
            made.output_batch_axis = _inputs_batch_axis(made.inputs, where)
        return made
    if callable(getattr(made, "generate", None)) and callable(made):
        return CausalLMServable(made)
    raise ConfigError(f"--model {where}: the factory must return (cell, signature), a servable "
                      f"(cell, inputs, forward) or a generate-capable model, got "
                      f"{type(made).__name__}")


def _inputs_batch_axis(inputs, where):
    """The axis outputs are split along when nothing says: the one the inputs batch along."""
    axes = sorted({spec.batch_axis for spec in inputs if spec.batch_axis is not None})
    if len(axes) > 1:
        raise ConfigError(f"--model {where}: the inputs batch along axes {axes}; return a servable object "
                          f"with output_batch_axis to say which axis of the outputs holds the rows")
    return axes[0] if axes else 0


def output_arrays(out):
    """A forward's result as a list of numpy arrays."""
    items = out if isinstance(out, (tuple, list)) else [out]
    arrays = []
    for item in items:
        if hasattr(item, "logits") and not hasattr(item, "asnumpy"):
            item = item.logits            # an HF-style output object
        arrays.append(item.asnumpy() if hasattr(item, "asnumpy") else np.asarray(item))
    return arrays


@dataclass
class JoinCheck:
    """Whether one kind of call's joined outputs split into each request's own
    (prefetchd.serve.execute): `verdict` None while untried or unsettled, after `checks`
    joined batches of distinct requests that did; True or False once settled."""
    verdict: bool | None = None
    checks: int = 0
    pending: object = field(default=None, repr=False, compare=False)   # the next check, run once
                                 # the worker replied (execute.finish_join_checks)


@dataclass
class ServedModel:
    """A model a worker serves: its servable, its offload handle, and the names of its
    first parameters (what a prefetch hint for it loads)."""
    name: str
    servable: object
    handle: object
    hints: list
    # Per kind of call ("infer", "generate"): whether its joined outputs split per request.
    joins: dict = field(default_factory=lambda: {"infer": JoinCheck(), "generate": JoinCheck()})

    def describe(self):
        """What the front needs to check and batch requests for it (sent in READY)."""
        return {"inputs": [s.to_json() for s in self.servable.inputs],
                "generate": callable(getattr(self.servable, "generate", None)),
                "hints": self.hints}
