"""0-d (scalar) parameters and outputs keep their shape through offload and a checkpoint
load: a scalar weight that came back as shape (1,) changed the model's output shapes (a
scalar output became a 1-element vector)."""
import numpy as np

import prefetchd

H = 64


def _net(ms):
    nn, ops = ms.nn, ms.ops

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(H, H)
            self.scale = ms.Parameter(ms.Tensor(np.array(1.5, np.float32)), name="scale")   # 0-d

        def construct(self, x):
            return ops.tanh(self.fc(x)) * self.scale

    class Head(nn.Cell):
        def __init__(self):
            super().__init__()
            self.k = ms.Parameter(ms.Tensor(np.array(3, np.int32)), name="k")              # 0-d int

        def construct(self, x):
            return x.mean() * self.k.astype(ms.float32)         # a 0-d output

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([Block() for _ in range(6)])
            self.head = Head()

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Net()


def _model_bytes(model):
    return sum(p.asnumpy().nbytes for p in model.get_parameters())


def test_scalar_parameters_and_a_scalar_output_keep_shape_and_values_when_streamed(ms, make_daemon):
    ms.set_seed(0)
    model = _net(ms)
    x = ms.Tensor(np.random.default_rng(1).standard_normal((2, H), dtype=np.float32))
    want = model(x).asnumpy()
    assert want.shape == ()
    daemon = make_daemon(device_budget=int(_model_bytes(model) * 0.6), host_budget=2 * _model_bytes(model))
    prefetchd.offload(model, daemon, lookahead=1)
    assert model.blocks[0].scale.shape == () and model.head.k.shape == ()
    for _ in range(3):      # the budget holds ~half the blocks: each pass evicts and reloads
        got = model(x).asnumpy()
        assert got.shape == () and np.array_equal(got, want)
    with daemon.use([model.blocks[3].scale, model.head.k]):
        assert model.blocks[3].scale.asnumpy().shape == ()
        assert model.head.k.asnumpy() == 3


def test_a_checkpoint_with_scalar_parameters_loads_into_an_offloaded_model(ms, make_daemon, tmp_path):
    ms.set_seed(0)
    model = _net(ms)
    x = ms.Tensor(np.random.default_rng(1).standard_normal((2, H), dtype=np.float32))
    ms.set_seed(7)
    other = _net(ms)
    for i, block in enumerate(other.blocks):
        block.scale.set_data(ms.Tensor(np.array(0.5 + i, np.float32)))
    want = other(x).asnumpy()
    path = str(tmp_path / "other.ckpt")
    ms.save_checkpoint(other, path)
    daemon = make_daemon(device_budget=int(_model_bytes(model) * 0.6), host_budget=2 * _model_bytes(model))
    prefetchd.offload(model, daemon, lookahead=1)
    model(x)
    assert prefetchd.load_param_into_net(model, ms.load_checkpoint(path)) == ([], [])
    for _ in range(3):
        got = model(x).asnumpy()
        assert got.shape == () and np.array_equal(got, want)
    assert model.blocks[5].scale.shape == ()
