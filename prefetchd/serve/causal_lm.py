"""The servable of an HF-style causal language model: any generate-capable
MindSpore cell (mindone's LlamaForCausalLM, prefetchd.serve.tiny_lm), used
duck-typed:

    model(input_ids)                          -> logits, a tuple whose first item
                                                 is them, or an object with .logits
    model.generate(input_ids, max_new_tokens=N, do_sample=False)
                                              -> prompt + N new ids (or the new ids)
    model.config.vocab_size, .max_position_embeddings   (optional: bounds checked)

`forward` returns the logits; `generate` the greedy new tokens, (batch, N) int64.
"""
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

    def forward(self, input_ids):
        import mindspore as ms
        out = self.cell(ms.Tensor(input_ids))
        if isinstance(out, (tuple, list)):
            out = out[0]
        return getattr(out, "logits", out)

    def generate(self, input_ids, max_new_tokens):
        import mindspore as ms
        prompt = input_ids.shape[1]
        if self.max_len is not None and prompt + max_new_tokens > self.max_len:
            raise BadArguments(f"a prompt of {prompt} tokens plus {max_new_tokens} new ones is "
                               f"over the model's {self.max_len} positions")
        out = self.cell.generate(ms.Tensor(input_ids), max_new_tokens=max_new_tokens,
                                 do_sample=False)
        out = out.asnumpy() if hasattr(out, "asnumpy") else np.asarray(out)
        if out.shape[1] >= prompt and np.array_equal(out[:, :prompt], input_ids):
            out = out[:, prompt:]             # HF decoder-only models return prompt + new
        return out.astype(np.int64)
