"""A small causal language model of our own, HF-style: `model(input_ids, past,
offset) -> (logits, presents)` with a KV cache, and `generate(input_ids,
max_new_tokens, do_sample=False)` returning the prompt followed by the greedy
tokens, as transformers' (and mindone's) `generate` does. What the serving tests
and `bench serve` generate with; prefetchd.serve.causal_lm adapts it exactly as
it adapts mindone's LlamaForCausalLM.

    --model prefetchd.serve.tiny_lm:build
"""
import math
from types import SimpleNamespace

import numpy as np


def _classes():
    import mindspore as ms
    from mindspore import nn, ops

    class Block(nn.Cell):
        def __init__(self, hidden, heads):
            super().__init__()
            self.heads, self.head_dim = heads, hidden // heads
            self.ln1 = nn.LayerNorm((hidden,))
            self.qkv = nn.Dense(hidden, 3 * hidden)
            self.proj = nn.Dense(hidden, hidden)
            self.ln2 = nn.LayerNorm((hidden,))
            self.fc1 = nn.Dense(hidden, 4 * hidden)
            self.fc2 = nn.Dense(4 * hidden, hidden)

        def _heads(self, t, b, n):
            return t.reshape(b, n, self.heads, self.head_dim).transpose(0, 2, 1, 3)

        def construct(self, x, mask, past_k=None, past_v=None):
            b, n, hidden = x.shape
            q, k, v = ops.split(self.qkv(self.ln1(x)), hidden, axis=-1)
            q, k, v = self._heads(q, b, n), self._heads(k, b, n), self._heads(v, b, n)
            if past_k is not None:
                k, v = ops.cat((past_k, k), axis=2), ops.cat((past_v, v), axis=2)
            att = ops.matmul(q, k.transpose(0, 1, 3, 2)) / math.sqrt(self.head_dim) + mask
            y = ops.matmul(ops.softmax(att, -1), v).transpose(0, 2, 1, 3).reshape(b, n, hidden)
            x = x + self.proj(y)
            return x + self.fc2(ops.gelu(self.fc1(self.ln2(x)))), k, v

    class TinyCausalLM(nn.Cell):
        def __init__(self, vocab=64, hidden=32, layers=2, heads=2, max_len=64):
            super().__init__()
            self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=max_len,
                                          hidden_size=hidden, num_hidden_layers=layers)
            self.embed = nn.Embedding(vocab, hidden)
            self.pos = nn.Embedding(max_len, hidden)
            self.blocks = nn.CellList([Block(hidden, heads) for _ in range(layers)])
            self.norm = nn.LayerNorm((hidden,))
            self.head = nn.Dense(hidden, vocab, has_bias=False)

        def construct(self, input_ids, past=None, offset=0):
            n = input_ids.shape[1]
            positions = ms.Tensor(np.arange(offset, offset + n, dtype=np.int64)[None, :])
            # Position i (absolute offset + i) sees keys 0..offset + i.
            allowed = np.arange(offset + n)[None, :] <= (offset + np.arange(n))[:, None]
            mask = ms.Tensor(np.where(allowed, 0.0, -1e9).astype(np.float32))
            x = self.embed(input_ids) + self.pos(positions)
            presents = []
            for i, block in enumerate(self.blocks):
                pk, pv = past[i] if past is not None else (None, None)
                x, k, v = block(x, mask, pk, pv)
                presents.append((k, v))
            return self.head(self.norm(x)), tuple(presents)

        def generate(self, input_ids, max_new_tokens=16, do_sample=False, **_):
            if do_sample:
                raise ValueError("TinyCausalLM.generate is greedy only (do_sample=False)")
            ids = input_ids.asnumpy() if hasattr(input_ids, "asnumpy") else np.asarray(input_ids)
            tokens, past, offset, step = ids, None, 0, ids
            for _ in range(max_new_tokens):
                logits, past = self(ms.Tensor(step), past, offset)
                offset += step.shape[1]
                step = logits[:, -1, :].asnumpy().argmax(-1).astype(ids.dtype)[:, None]
                tokens = np.concatenate([tokens, step], axis=1)
            return ms.Tensor(tokens)

    return TinyCausalLM


def build(seed=0, vocab=64, hidden=32, layers=2, heads=2, max_len=64):
    """A TinyCausalLM with seeded weights (normal, std 0.5: logits far enough apart that
    greedy tokens do not hinge on rounding)."""
    import mindspore as ms
    model = _classes()(vocab, hidden, layers, heads, max_len)
    rng = np.random.default_rng(seed)
    for p in model.get_parameters():
        if "ln" in p.name or "norm" in p.name:
            continue
        p.set_data(ms.Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    return model
