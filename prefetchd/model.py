"""The demo model: a transformer-style stack of MindSpore blocks.

Each block is pre-norm self-attention (one fused QKV projection, one output
projection) followed by a pre-norm MLP (4x expansion), with residuals. Weights
are fp32; `estimate_bytes` tells the size before anything is allocated, and
`build_model(..., materialize=False)` builds it without allocating parameter
memory (MindSpore's `no_init_parameters`), so a model larger than RAM can be
described and then streamed from the remote tier.
"""
import math
import zlib

import numpy as np

from .backend.framework import mindspore


def block_params(hidden):
    """Parameter count of one block (QKV, out, two MLP projections, two norms)."""
    return (hidden * 3 * hidden + 3 * hidden) + (hidden * hidden + hidden) \
        + (hidden * 4 * hidden + 4 * hidden) + (4 * hidden * hidden + hidden) + 4 * hidden


def estimate_bytes(hidden, layers, itemsize=4):
    return (block_params(hidden) * layers + 2 * hidden) * itemsize


def layers_for(total_bytes, hidden, itemsize=4):
    return max(1, round(total_bytes / (block_params(hidden) * itemsize)))


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

    class DemoModel(nn.Cell):
        """Blocks in a CellList: each block is one offload unit."""

        def __init__(self, hidden, layers, heads):
            super().__init__()
            self.blocks = nn.CellList([Block(hidden, heads) for _ in range(layers)])
            self.norm = nn.LayerNorm((hidden,))

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    return Block, DemoModel


def init_values(name, shape, seed=0):
    """Deterministic values of one parameter, from its name: no need to build the model."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    if len(shape) == 2:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / math.sqrt(shape[1]))
    if name.endswith("gamma"):
        return np.ones(shape, np.float32)
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)


def build_model(hidden=1024, layers=8, heads=None, seed=0, materialize=True):
    """A DemoModel. materialize=False allocates no parameter memory (weights come from a store)."""
    ms = mindspore()
    heads = heads or max(1, hidden // 128)
    _, DemoModel = _classes()
    from mindspore.nn.utils import no_init_parameters
    with no_init_parameters():
        model = DemoModel(hidden, layers, heads)
    if materialize:
        for p in model.get_parameters():
            p.set_data(ms.Tensor.from_numpy(init_values(p.name, tuple(p.shape), seed)))
    return model


def make_inputs(batch=8, seq=16, hidden=1024, seed=1):
    ms = mindspore()
    rng = np.random.default_rng(seed)
    return ms.Tensor.from_numpy(rng.standard_normal((batch, seq, hidden), dtype=np.float32))
