"""Real model code streamed with the README's usage, at about a quarter of the weights.

mindcv (MindSpore's model zoo; a test dependency) for a ResNet-50 and a ViT,
plus language-model layouts written the way public zoos write them (below).
Every pass must equal the resident model, stay under the high watermark and,
in steady state, never miss.
"""
import re
import sys
import types

import numpy as np
import pytest

import prefetchd
from prefetchd.hooks.planner import param_nbytes

try:
    import tqdm  # noqa: F401  (mindcv imports it for download progress bars only)
except ImportError:     # a venv where mindcv was installed with --no-deps; no downloads here
    sys.modules["tqdm"] = types.SimpleNamespace(tqdm=None)
mindcv = pytest.importorskip("mindcv")

FRACTION = 0.25
PASSES = 3




def zoo_classes(ms):
    nn, ops = ms.nn, ms.ops

    class GPT2Attention(nn.Cell):
        def __init__(self, hidden, heads):
            super().__init__()
            self.heads, self.head_dim = heads, hidden // heads
            self.c_attn = nn.Dense(hidden, 3 * hidden)
            self.c_proj = nn.Dense(hidden, hidden)

        def construct(self, x):
            b, t, h = x.shape
            qkv = self.c_attn(x.reshape(b * t, h)).reshape(b, t, 3, self.heads, self.head_dim)
            q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
            attn = ops.softmax(ops.matmul(q, k.transpose(0, 1, 3, 2)) / np.sqrt(self.head_dim), axis=-1)
            out = ops.matmul(attn, v).transpose(0, 2, 1, 3).reshape(b * t, h)
            return self.c_proj(out).reshape(b, t, h)

    class GPT2MLP(nn.Cell):
        def __init__(self, hidden):
            super().__init__()
            self.c_fc = nn.Dense(hidden, 4 * hidden)
            self.c_proj = nn.Dense(4 * hidden, hidden)
            self.act = nn.GELU(approximate=False)

        def construct(self, x):
            b, t, h = x.shape
            return self.c_proj(self.act(self.c_fc(x.reshape(b * t, h)))).reshape(b, t, h)

    class GPT2Block(nn.Cell):
        def __init__(self, hidden, heads):
            super().__init__()
            self.ln_1 = nn.LayerNorm((hidden,))
            self.attn = GPT2Attention(hidden, heads)
            self.ln_2 = nn.LayerNorm((hidden,))
            self.mlp = GPT2MLP(hidden)

        def construct(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class GPT2Model(nn.Cell):
        def __init__(self, vocab, positions, hidden, heads, layers):
            super().__init__()
            self.wte = nn.Embedding(vocab, hidden)
            self.wpe = nn.Embedding(positions, hidden)
            self.h = nn.CellList([GPT2Block(hidden, heads) for _ in range(layers)])
            self.ln_f = nn.LayerNorm((hidden,))

        def construct(self, ids):
            x = self.wte(ids) + self.wpe(ops.arange(ids.shape[1]).reshape(1, -1))
            for block in self.h:
                x = block(x)
            return self.ln_f(x)

    class GPT2LMHeadModel(nn.Cell):
        def __init__(self, vocab=512, positions=16, hidden=128, heads=4, layers=8):
            super().__init__()
            self.transformer = GPT2Model(vocab, positions, hidden, heads, layers)

        def construct(self, ids):
            hidden = self.transformer(ids)
            # Tied LM head: the token embedding table, read here, outside any block.
            return ops.matmul(hidden, self.transformer.wte.embedding_table.T)

    class RMSNorm(nn.Cell):
        def __init__(self, hidden, eps=1e-6):
            super().__init__()
            self.weight = ms.Parameter(ms.Tensor(np.ones(hidden, np.float32)), name="weight")
            self.eps = eps

        def construct(self, x):
            return x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.eps) * self.weight

    class LlamaAttention(nn.Cell):
        def __init__(self, hidden, heads):
            super().__init__()
            self.heads, self.head_dim = heads, hidden // heads
            self.q_proj = nn.Dense(hidden, hidden, has_bias=False)
            self.k_proj = nn.Dense(hidden, hidden, has_bias=False)
            self.v_proj = nn.Dense(hidden, hidden, has_bias=False)
            self.o_proj = nn.Dense(hidden, hidden, has_bias=False)

        def construct(self, x):
            b, t, h = x.shape
            flat = x.reshape(b * t, h)
            q, k, v = (p(flat).reshape(b, t, self.heads, self.head_dim).transpose(0, 2, 1, 3)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            attn = ops.softmax(ops.matmul(q, k.transpose(0, 1, 3, 2)) / np.sqrt(self.head_dim), axis=-1)
            return self.o_proj(ops.matmul(attn, v).transpose(0, 2, 1, 3).reshape(b * t, h)).reshape(b, t, h)

    class LlamaMLP(nn.Cell):
        def __init__(self, hidden, intermediate):
            super().__init__()
            self.gate_proj = nn.Dense(hidden, intermediate, has_bias=False)
            self.up_proj = nn.Dense(hidden, intermediate, has_bias=False)
            self.down_proj = nn.Dense(intermediate, hidden, has_bias=False)

        def construct(self, x):
            b, t, h = x.shape
            flat = x.reshape(b * t, h)
            return self.down_proj(ops.silu(self.gate_proj(flat)) * self.up_proj(flat)).reshape(b, t, h)

    class LlamaDecoderLayer(nn.Cell):
        def __init__(self, hidden, heads, intermediate):
            super().__init__()
            self.input_layernorm = RMSNorm(hidden)
            self.self_attn = LlamaAttention(hidden, heads)
            self.post_attention_layernorm = RMSNorm(hidden)
            self.mlp = LlamaMLP(hidden, intermediate)

        def construct(self, x):
            x = x + self.self_attn(self.input_layernorm(x))
            return x + self.mlp(self.post_attention_layernorm(x))

    class LlamaModel(nn.Cell):
        def __init__(self, vocab, hidden, heads, intermediate, layers):
            super().__init__()
            self.embed_tokens = nn.Embedding(vocab, hidden)
            self.layers = nn.CellList([LlamaDecoderLayer(hidden, heads, intermediate) for _ in range(layers)])
            self.norm = RMSNorm(hidden)

        def construct(self, ids):
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = layer(x)
            return self.norm(x)

    class LlamaForCausalLM(nn.Cell):
        def __init__(self, vocab=512, hidden=128, heads=4, intermediate=344, layers=8):
            super().__init__()
            self.model = LlamaModel(vocab, hidden, heads, intermediate, layers)
            self.lm_head = nn.Dense(hidden, vocab, has_bias=False)

        def construct(self, ids):
            return self.lm_head(self.model(ids).reshape(-1, self.model.norm.weight.shape[0]))

    class MlpBlock(nn.Cell):
        def __init__(self, dim):
            super().__init__()
            self.norm = nn.LayerNorm((dim,))
            self.fc1 = nn.Dense(dim, 4 * dim)
            self.fc2 = nn.Dense(4 * dim, dim)

        def construct(self, x):
            return x + self.fc2(ops.gelu(self.fc1(self.norm(x))))

    class Stage(nn.Cell):
        def __init__(self, dim, depth):
            super().__init__()
            self.blocks = nn.CellList([MlpBlock(dim) for _ in range(depth)])
            self.norm = nn.LayerNorm((dim,))

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return self.norm(x)

    class StagedNet(nn.Cell):
        def __init__(self, dim=32, stages=3, depth=8, classes=10):
            super().__init__()
            self.stem = nn.Dense(16, dim)
            self.layers = nn.CellList([Stage(dim, depth) for _ in range(stages)])
            self.head = nn.Dense(dim, classes)

        def construct(self, x):
            x = self.stem(x)
            for stage in self.layers:
                x = stage(x)
            return self.head(x)

    return GPT2LMHeadModel, LlamaForCausalLM, StagedNet


def weight_bytes(model):
    return sum(param_nbytes(p) for p in {id(p): p for p in model.get_parameters()}.values())


def stream_like_the_readme(model, x, store_dir, fraction=FRACTION):
    """README usage exactly; returns the plan. Asserts every pass equals the resident model."""
    model.set_train(False)
    want = model(x).asnumpy()
    budget = int(weight_bytes(model) * fraction)
    with prefetchd.Daemon(device_budget=budget, store_dir=store_dir) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=2)
        for i in range(PASSES):
            np.testing.assert_array_equal(model(x).asnumpy(), want, err_msg=f"pass {i}")
        status = daemon.status()["device"]
        assert 0 < status["peak"] <= status["high_watermark"]
        stats = handle.stats()
        assert stats["resyncs"] == 0, stats
        assert stats["trace"] == len(handle.plan().units) + 1
        assert stats["misses"] == 0, stats
        return handle.plan()


@pytest.fixture
def zoo(ms):
    return zoo_classes(ms)


def resnet50(ms):
    from mindcv.models import create_model
    ms.set_seed(1)
    model = create_model("resnet50", num_classes=10)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32))
    return model, x


def test_mindcv_resnet50(ms, tmp_path):
    model, x = resnet50(ms)
    plan = stream_like_the_readme(model, x, str(tmp_path / "store"))
    names = [u.name for u in plan.units]
    assert names[0].startswith("layer1.0")          # blocks found under layer1..4 (SequentialCells)
    assert "layer4.1.conv2" in names                # a 9.4 MB conv above its share stands alone
    assert {"conv1.weight", "classifier.weight"} <= set(plan.root.param_names)


def test_mindcv_vit_root_params_are_streamed(ms, tmp_path):
    from mindcv.models.vit import VisionTransformer
    ms.set_seed(2)
    model = VisionTransformer(image_size=32, patch_size=8, embed_dim=192, depth=6, num_heads=3, num_classes=10)
    x = ms.Tensor(np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32))
    plan = stream_like_the_readme(model, x, str(tmp_path / "store"))
    assert {"pos_embed", "cls_token"} <= set(plan.root.param_names)
    assert all(u.name.startswith("blocks.") for u in plan.units)


def test_mindcv_vit_from_a_checkpoint_loads_the_root_params(ms, tmp_path):
    """pos_embed/cls_token belong to the top-level cell: the checkpoint path loads them too."""
    from mindcv.models.vit import VisionTransformer

    def build():
        return VisionTransformer(image_size=32, patch_size=8, embed_dim=96, depth=4, num_heads=3,
                                 num_classes=10)
    source = build()
    source.set_train(False)
    x = ms.Tensor(np.random.default_rng(3).standard_normal((2, 3, 32, 32)).astype(np.float32))
    want = source(x).asnumpy()
    ms.save_checkpoint(source, str(tmp_path / "vit.ckpt"))
    model = build()                                   # other random weights
    model.set_train(False)
    with prefetchd.Daemon(device_budget=int(weight_bytes(source) * FRACTION),
                          store_dir=str(tmp_path / "store")) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=2, checkpoint=str(tmp_path / "vit.ckpt"))
        for _ in range(PASSES):
            np.testing.assert_array_equal(model(x).asnumpy(), want)
        assert handle.stats()["misses"] == 0


def test_gpt2_layout_with_a_tied_head_read_in_the_top_level_construct(ms, zoo, tmp_path):
    gpt2, _, _ = zoo
    ms.set_seed(3)
    model = gpt2()
    ids = ms.Tensor(np.random.default_rng(2).integers(0, 512, (2, 16)).astype(np.int32))
    plan = stream_like_the_readme(model, ids, str(tmp_path / "store"))
    assert "transformer.wte.embedding_table" in plan.root.param_names     # pinned all forward
    assert all(re.match(r"transformer\.h\.\d+(\.|$)", u.name) for u in plan.units)


def test_llama_layout(ms, zoo, tmp_path):
    _, llama, _ = zoo
    ms.set_seed(4)
    model = llama()
    ids = ms.Tensor(np.random.default_rng(4).integers(0, 512, (2, 16)).astype(np.int32))
    plan = stream_like_the_readme(model, ids, str(tmp_path / "store"))
    assert {"lm_head.weight", "model.norm.weight", "model.embed_tokens.embedding_table"} \
        <= set(plan.root.param_names)
    assert all(re.match(r"model\.layers\.\d+(\.|$)", u.name) for u in plan.units)


def test_two_level_nesting(ms, zoo, tmp_path):
    _, _, staged = zoo
    ms.set_seed(5)
    model = staged()
    x = ms.Tensor(np.random.default_rng(5).standard_normal((4, 16)).astype(np.float32))
    # Its tensors are tiny (each reserves a whole 4 KiB page: 1.45x its bytes in all), so
    # a little more than the usual quarter keeps a block within its share.
    plan = stream_like_the_readme(model, x, str(tmp_path / "store"), fraction=0.3)
    names = [u.name for u in plan.units]
    # a stage is above its share: it is split into its blocks (and its own norm)
    assert all(re.fullmatch(r"layers\.\d\.(blocks\.\d+|norm)", n) for n in names), names
    assert sum(n.startswith("layers.") and ".blocks." in n for n in names) == 3 * 8


def test_a_model_that_can_never_fit_is_refused_at_offload_naming_the_tensor(ms, zoo, tmp_path):
    _, llama, _ = zoo
    model = llama(vocab=4096)                        # a 2 MiB embedding table
    with prefetchd.Daemon(device_budget="1MiB", store_dir=str(tmp_path / "store")) as daemon:
        with pytest.raises(prefetchd.BudgetError, match=r"'model\.embed_tokens\.embedding_table'.*2097152"):
            prefetchd.offload(model, daemon, lookahead=2)
        assert daemon.names() == []                  # refused before anything was registered


@pytest.mark.parametrize("name, size", [("res2net50", 64), ("edgenext_xx_small", 64), ("hrnet_w32", 64),
                                        ("swin_tiny", 224)])
def test_mindcv_models_with_celllists_inside_split_blocks(ms, tmp_path, name, size):
    """A block above its share is split; a CellList inside it (iterated or indexed,
    never called, so its hooks never fire) must not become a unit: its items do.
    Each of these died with SIGSEGV on its first offloaded forward before."""
    from mindcv.models import create_model
    ms.set_seed(1)
    model = create_model(name, num_classes=10)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 3, size, size)).astype(np.float32))
    plan = stream_like_the_readme(model, x, str(tmp_path / "store"))
    assert not any(isinstance(cell, (ms.nn.CellList, ms.nn.CellDict)) for u in plan.units for _, cell in u.cells)


def test_weights_read_outside_their_sub_cell_call_are_pinned(ms, tmp_path):
    """A block's construct reading its child's weight (kept whole), and the model's
    construct reading a block's weight (pinned in the root too): equal to resident."""
    nn, ops = ms.nn, ms.ops

    class Block(nn.Cell):
        def __init__(self, d):
            super().__init__()
            self.fc1, self.fc2 = nn.Dense(d, 2 * d), nn.Dense(2 * d, d)

        def construct(self, x):
            y = x + self.fc2(ops.tanh(self.fc1(x)))
            return y + ops.matmul(y, self.fc2.weight)[:, :y.shape[1]] * 0.01

    class Net(nn.Cell):
        def __init__(self, d=64):
            super().__init__()
            self.blocks = nn.CellList([Block(d) for _ in range(6)])

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return ops.matmul(x, self.blocks[0].fc1.weight.T)

    ms.set_seed(6)
    model = Net()
    x = ms.Tensor(np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32))
    plan = stream_like_the_readme(model, x, str(tmp_path / "store"), fraction=0.5)
    assert [u.name for u in plan.units] == [f"blocks.{i}" for i in range(6)]
    assert plan.root.param_names == ["blocks.0.fc1.weight"]
