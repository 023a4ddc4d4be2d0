"""The servable of an HF-style causal language model: any generate-capable
MindSpore cell (mindone's LlamaForCausalLM, prefetchd.serve.tiny_lm), used
duck-typed:

    model(input_ids)                          -> logits, a tuple whose first item
                                                 is them, or an object with .logits
    model.generate(input_ids, max_new_tokens=N, do_sample=False)
                                              -> prompt + N new ids (transformers' contract
                                                 for decoder-only models)
    model.config.vocab_size, .max_position_embeddings   (optional: bounds checked)

`forward` returns the logits; `generate` the greedy new tokens, (batch, N) int64.
A model whose generate returns only the new ids is served as a servable object
(prefetchd.serve.servable) instead: from ids alone, new ones that happen to repeat
the prompt cannot be told from it (the adapter used to guess, and dropped them).
"""
import inspect

import numpy as np

from ..control.codes import BadArguments
from .tensor_spec import TensorSpec


class CausalLMServable:
    output_batch_axis = 0

    def __init__(self, model, id_dtype="int64"):
        self.cell = model
        config = getattr(model, "config", None)
        self.vocab = getattr(config, "vocab_size", None)
        self.max_len = getattr(config, "max_position_embeddings", None)
        self.inputs = [TensorSpec((None, None), id_dtype, 0, "input_ids", self.vocab)]
        self._takes_min_new_tokens = _takes(model.generate, "min_new_tokens")

    def forward(self, input_ids):
        import mindspore as ms
        self._check_length(input_ids.shape[1], 0)
        out = self.cell(ms.Tensor(input_ids))
        if isinstance(out, (tuple, list)):
            out = out[0]
        return getattr(out, "logits", out)

    def _check_length(self, prompt, new):
        """BadArguments for an empty prompt, or one that with `new` ids is over the positions
        (else the model fails inside MindSpore, a C++ stack for the client). A greedy
        generate of `new` ids feeds the prompt and the first new - 1 of them: the last is
        only returned."""
        if prompt == 0:
            raise BadArguments("the input ids are empty (a prompt needs at least one token)")
        if self.max_len is not None and prompt + max(new - 1, 0) > self.max_len:
            raise BadArguments(f"a prompt of {prompt} token{'s' * (prompt != 1)}"
                               + (f" plus max_new_tokens={new}" if new else "")
                               + f" is over the model's {self.max_len} positions")

    def generate(self, input_ids, max_new_tokens):
        import mindspore as ms
        prompt = input_ids.shape[1]
        self._check_length(prompt, max_new_tokens)
        # The reply is N new ids: a generate that takes min_new_tokens (transformers') is
        # kept from stopping early at an end-of-sequence id.
        exact = {"min_new_tokens": max_new_tokens} if self._takes_min_new_tokens else {}
        out = self.cell.generate(ms.Tensor(input_ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, **exact)
        out = out.asnumpy() if hasattr(out, "asnumpy") else np.asarray(out)
        if out.shape != (input_ids.shape[0], prompt + max_new_tokens) \
                or not np.array_equal(out[:, :prompt], input_ids):
            starts = out.ndim == 2 and out.shape[1] >= prompt and np.array_equal(out[:, :prompt], input_ids)
            why = ("a model whose generate returns only the new ids is served as a servable object "
                   "(docs/control-plane.md)")
            if starts and out.shape[1] < prompt + max_new_tokens:
                why = (f"either it stopped after {out.shape[1] - prompt} new ids (an end-of-sequence id, and "
                       f"its generate takes no min_new_tokens to go on), or {why}")
            raise RuntimeError(f"{type(self.cell).__name__}.generate returned ids of shape {list(out.shape)}, "
                               f"not the prompt ({prompt} ids) and {max_new_tokens} new ones: {why}")
        return out[:, prompt:].astype(np.int64)


def _takes(function, name):
    """Whether `function` accepts the keyword `name` (named, or through **kwargs)."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == name or p.kind is p.VAR_KEYWORD for p in parameters)
