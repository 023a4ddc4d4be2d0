"""The demo model: a small language-model-shaped transformer of MindSpore blocks.

Laid out the way public model zoos do, with parameters outside the blocks:

- a tied embedding table (`embedding`, vocab x hidden): token ids are looked
  up in it at the input, and the same table is the output projection
  (`logits = h @ embedding.T`), both read in the top-level construct;
- a positional embedding (`pos_embed`) and a final norm (`final_norm.gamma`,
  `final_norm.beta`) owned by the top-level cell itself, not by a child cell;
- `blocks`: a CellList of pre-norm self-attention (one fused QKV projection,
  one output projection) + pre-norm MLP (4x expansion) blocks, with residuals.

The input is token ids (int, batch x seq) or, for callers that feed hidden
states, floats (batch x seq x hidden) that skip the lookup; the output is
logits (batch x seq x vocab). Weights are fp32; `estimate_bytes` tells the size
before anything is allocated, and `build_model(..., materialize=False)` builds
it without allocating parameter memory (MindSpore's `no_init_parameters`), so
a model larger than RAM can be described and then streamed from the remote tier.
"""
import math
import zlib

import numpy as np

from ..backend.framework import mindspore

MAX_SEQ = 128   # positions the positional embedding covers


def vocab_for(hidden):
    """Vocabulary size of the demo model at width `hidden` (scales with it, so the
    top-level parameters stay a small share of the weights at any size)."""
    return max(256, 2 * hidden)


def block_params(hidden):
    """Parameter count of one block (QKV, out, two MLP projections, two norms)."""
    return (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden) \
        + (hidden * 4 * hidden + 4 * hidden) + (4 * hidden * hidden + hidden) + 4 * hidden


def top_params(hidden):
    """Parameter count outside the blocks: tied embedding, positional embedding, final norm."""
    return vocab_for(hidden) * hidden + MAX_SEQ * hidden + 2 * hidden


def estimate_bytes(hidden, layers, itemsize=4):
    return (block_params(hidden) * layers + top_params(hidden)) * itemsize


def layers_for(total_bytes, hidden, itemsize=4):
    """Blocks that make the model about `total_bytes` (at least one)."""
    return max(1, round((total_bytes / itemsize - top_params(hidden)) / block_params(hidden)))


def _classes():
    ms = mindspore()
    nn, ops = ms.nn, ms.ops

    class Block(nn.Cell):
        def __init__(self, hidden, heads):
            super().__init__()
            self.heads = heads
            self.head_dim = hidden // heads
            self.norm1 = nn.LayerNorm((hidden,))
            self.qkv = nn.Dense(hidden, 3 * hidden)
            self.proj = nn.Dense(hidden, hidden)
            self.norm2 = nn.LayerNorm((hidden,))
            self.up = nn.Dense(hidden, 4 * hidden)
            self.down = nn.Dense(4 * hidden, hidden)
            self.act = nn.GELU(approximate=False)
            self.scale = 1.0 / math.sqrt(self.head_dim)

        def construct(self, x):
            b, t, h = x.shape
            qkv = self.qkv(self.norm1(x).reshape(b * t, h)).reshape(b, t, 3, self.heads, self.head_dim)
            q = qkv[:, :, 0].transpose(0, 2, 1, 3)
            k = qkv[:, :, 1].transpose(0, 2, 3, 1)
            v = qkv[:, :, 2].transpose(0, 2, 1, 3)
            attn = ops.softmax(ops.matmul(q, k) * self.scale, axis=-1)
            mixed = ops.matmul(attn, v).transpose(0, 2, 1, 3).reshape(b * t, h)
            x = x + self.proj(mixed).reshape(b, t, h)
            y = self.down(self.act(self.up(self.norm2(x).reshape(b * t, h))))
            return x + y.reshape(b, t, h)

    def parameter(name, shape):
        return ms.Parameter(ms.common.initializer.initializer("zeros", shape, ms.float32), name=name)

    class DemoModel(nn.Cell):
        """Tied embedding and top-level parameters around blocks in a CellList."""

        def __init__(self, hidden, layers, heads, vocab):
            super().__init__()
            self.embedding = parameter("embedding", (vocab, hidden))
            self.pos_embed = parameter("pos_embed", (MAX_SEQ, hidden))
            self.blocks = nn.CellList([Block(hidden, heads) for _ in range(layers)])
            self.norm_gamma = parameter("final_norm.gamma", (hidden,))
            self.norm_beta = parameter("final_norm.beta", (hidden,))
            self.layer_norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1)

        def construct(self, x):
            if x.dtype in (ms.int32, ms.int64):
                x = ops.gather(self.embedding, x, 0)           # ids -> vectors: the table, read here
            b, t, h = x.shape
            if t > self.pos_embed.shape[0]:
                raise ValueError(f"demo model: sequence length {t} exceeds its {MAX_SEQ} positions")
            x = x + self.pos_embed[:t]
            for block in self.blocks:
                x = block(x)
            x, _, _ = self.layer_norm(x, self.norm_gamma, self.norm_beta)
            logits = ops.matmul(x.reshape(b * t, h), self.embedding.T)   # the same table, tied
            return logits.reshape(b, t, -1)

    return Block, DemoModel


def init_values(name, shape, seed=0):
    """Deterministic values of one parameter, from its name: no need to build the model."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if len(shape) == 2:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / math.sqrt(shape[1]))
    if name.endswith("gamma"):
        return np.ones(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)


def build_model(hidden=1024, layers=8, heads=None, seed=0, materialize=True, progress=None):
    """A DemoModel. materialize=False allocates no parameter memory (weights come from a store).

    progress: called as progress(done, total) after each parameter is filled in.
    """
    ms = mindspore()
    heads = heads or max(1, hidden // 128)
    _, DemoModel = _classes()
    from mindspore.nn.utils import no_init_parameters
    with no_init_parameters():
        model = DemoModel(hidden, layers, heads, vocab_for(hidden))
    if materialize:
        params = list(model.get_parameters())
        for i, p in enumerate(params):
            p.set_data(ms.Tensor.from_numpy(init_values(p.name, tuple(p.shape), seed)))
            if progress is not None:
                progress(i + 1, len(params))
    return model


def make_inputs(batch=8, seq=16, hidden=None, seed=1):
    """Token ids (int32, batch x seq) for a model of width `hidden` (its vocabulary)."""
    ms = mindspore()
    if seq > MAX_SEQ:
        raise ValueError(f"make_inputs: seq {seq} exceeds the demo model's {MAX_SEQ} positions")
    vocab = vocab_for(hidden) if hidden else 256
    rng = np.random.default_rng(seed)
    return ms.Tensor.from_numpy(rng.integers(0, vocab, (batch, seq), dtype=np.int32))
