"""Real MindSpore kernels that write managed Parameters in place, streamed with the
README's usage: the writes must survive eviction (each pass equals the resident
model), and a model that writes nothing must cost no write-back.

Kernels write a Parameter's storage without its Python API, so the guard never
sees it: BatchNorm's running statistics in training mode, a KV cache kept in
Parameters and updated with ops.assign / scatter_update (as MindSpore LLM code
does), in PyNative and under @jit. The cpu backend maps resident homes
read-only and counts their first write (tests/native/test_write_watch.py).
"""
import numpy as np
import pytest

import prefetchd
from prefetchd.hooks.planner import param_nbytes

PASSES = 4


def weight_bytes(model):
    return sum(param_nbytes(p) for p in {id(p): p for p in model.get_parameters()}.values())


def twin(ms, build):
    """Two models with the same initial values: one resident, one to offload."""
    ms.set_seed(7)
    ref, net = build(), build()
    ms.load_param_into_net(net, {p.name: ms.Parameter(p.data.copy(), name=p.name)
                                 for p in ref.get_parameters()})
    return ref, net


def stats(daemon):
    return daemon.snapshot()[1]


def bn_net(ms):
    nn = ms.nn

    class Block(nn.Cell):
        def __init__(self, c):
            super().__init__()
            self.conv = nn.Conv2d(c, c, 3, pad_mode="same")
            self.bn = nn.BatchNorm2d(c)

        def construct(self, x):
            return ms.ops.relu(self.bn(self.conv(x)))

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.SequentialCell([Block(32) for _ in range(8)])

        def construct(self, x):
            return self.blocks(x).mean(axis=(2, 3))

    return Net


def kv_net(ms, jit=False):
    nn, ops = ms.nn, ms.ops

    class Attention(nn.Cell):
        """Keeps its keys in a Parameter cache written at `pos` every step."""

        def __init__(self, hidden, steps):
            super().__init__()
            self.proj = nn.Dense(hidden, hidden)
            self.cache = ms.Parameter(ms.Tensor(np.zeros((steps, hidden), np.float32)), name="cache",
                                      requires_grad=False)
            self.pos = ms.Parameter(ms.Tensor(np.zeros((1,), np.int32)), name="pos", requires_grad=False)

        def construct(self, x):
            k = self.proj(x)
            ops.scatter_update(self.cache, self.pos, k)
            ops.assign(self.pos, self.pos + 1)
            return k + self.cache.sum(0, keepdims=True)

    if jit:
        Attention.construct = ms.jit(Attention.construct)

    class Layer(nn.Cell):
        def __init__(self, hidden, steps):
            super().__init__()
            self.attn = Attention(hidden, steps)
            self.mlp = nn.Dense(hidden, hidden)

        def construct(self, x):
            return self.mlp(self.attn(x))

    class Net(nn.Cell):
        def __init__(self, hidden=128, steps=16, layers=6):
            super().__init__()
            self.layers = nn.CellList([Layer(hidden, steps) for _ in range(layers)])

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Net


def test_batchnorm_in_training_mode_keeps_its_running_statistics(ms, tmp_path):
    ref, net = twin(ms, bn_net(ms))
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 32, 8, 8)).astype(np.float32))
    with prefetchd.Daemon(device_budget=weight_bytes(ref) // 4, store_dir=str(tmp_path / "store")) as daemon:
        prefetchd.offload(net, daemon, lookahead=1)
        ref.set_train(True)
        net.set_train(True)
        for i in range(PASSES):
            np.testing.assert_array_equal(net(x).asnumpy(), ref(x).asnumpy(), err_msg=f"train pass {i}")
        ref.set_train(False)
        net.set_train(False)
        # Eval mode reads the running statistics the training passes wrote.
        np.testing.assert_array_equal(net(x).asnumpy(), ref(x).asnumpy(), err_msg="eval after training")
        assert stats(daemon).compute_writes > 0


@pytest.mark.parametrize("jit", [False, True], ids=["pynative", "jit"])
def test_a_kv_cache_kept_in_parameters_survives_eviction_step_after_step(ms, tmp_path, jit):
    ref, net = twin(ms, kv_net(ms, jit))
    ref.set_train(False)
    net.set_train(False)
    rng = np.random.default_rng(1)
    steps = [ms.Tensor(rng.standard_normal((1, 128)).astype(np.float32)) for _ in range(6)]
    with prefetchd.Daemon(device_budget=weight_bytes(ref) // 3, store_dir=str(tmp_path / "store")) as daemon:
        handle = prefetchd.offload(net, daemon, lookahead=1)
        assert handle.plan().root.nbytes == 0          # the caches stream with their layers
        for i, x in enumerate(steps):
            np.testing.assert_array_equal(net(x).asnumpy(), ref(x).asnumpy(), err_msg=f"step {i}")
        assert stats(daemon).compute_writes > 0 and handle.stats()["misses"] == 0


def test_a_model_that_writes_nothing_is_never_written_back(ms, tmp_path):
    nn = ms.nn
    ms.set_seed(3)
    model = nn.SequentialCell([nn.SequentialCell([nn.Dense(256, 256), nn.ReLU()]) for _ in range(8)])
    model.set_train(False)
    x = ms.Tensor(np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32))
    want = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=weight_bytes(model) // 3, store_dir=str(tmp_path / "store")) as daemon:
        prefetchd.offload(model, daemon, lookahead=1)
        for i in range(PASSES):
            np.testing.assert_array_equal(model(x).asnumpy(), want, err_msg=f"pass {i}")
        s = stats(daemon)
        assert s.evictions["watermark"] > 0                  # it did stream
        assert s.compute_writes == 0 and s.writebacks == 0


def test_a_kernel_write_inside_use_is_kept_after_eviction(ms, daemon):
    p = ms.Parameter(ms.Tensor(np.zeros(4096, np.float32)), name="w")
    daemon.register(p, "w", tier="remote")
    with daemon.use([p]):
        ms.ops.assign(p, ms.Tensor(np.full(4096, 3.0, np.float32)))
        ms.hal.synchronize()
    daemon.evict([p]).result(30)
    assert stats(daemon).compute_writes == 1 and stats(daemon).writebacks == 1
    with daemon.use([p]):
        assert float(p.asnumpy().sum()) == 3.0 * 4096


def test_tensors_says_dirty_once_a_kernel_wrote_it(ms, daemon):
    # `dirty` (tensors(), `ctl list`) was False until eviction looked: the write was kept,
    # but the report said there was nothing to write back (an outside probe).
    p = ms.Parameter(ms.Tensor(np.zeros(4096, np.float32)), name="w")
    daemon.register(p, "w", tier="remote")
    with daemon.use([p]):
        assert daemon.tensors("w")[0]["dirty"] is False
        ms.ops.assign(p, ms.Tensor(np.full(4096, 3.0, np.float32)))
        ms.hal.synchronize()
        assert daemon.tensors("w")[0]["dirty"] is True
    assert daemon.tensors("w")[0]["dirty"] is True
    daemon.flush().result(30)
    assert daemon.tensors("w")[0]["dirty"] is False and stats(daemon).writebacks == 1
    assert stats(daemon).compute_writes == 1


def raising_cache_net(ms):
    nn, ops = ms.nn, ms.ops

    class Net(nn.Cell):
        """Writes a Parameter every pass; with fail=True raises right after the write."""

        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([nn.Dense(256, 256) for _ in range(6)])
            self.cache = ms.Parameter(ms.Tensor(np.zeros((1, 256), np.float32)), name="cache",
                                      requires_grad=False)

        def construct(self, x, fail=False):
            for block in self.blocks:
                x = block(x)
            ops.assign(self.cache, self.cache + x.mean(axis=0, keep_dims=True))
            if fail:
                raise ValueError("the user's error, after the write")
            return x + self.cache.sum()

    return Net


def test_a_write_queued_by_a_forward_that_raised_is_kept_at_close(ms, tmp_path):
    """The forward raised right after dispatching an ops.assign; the daemon closed at once.
    The kernel was still queued when the scheduler looked for writes the last time, and the
    write was lost with the daemon ("closed with 1 dirty tensor(s) not written back: cache"),
    in about two closes of three. close() now lets queued compute run first."""
    ref, _ = twin(ms, raising_cache_net(ms))
    x = ms.Tensor(np.random.default_rng(3).standard_normal((64, 256)).astype(np.float32))
    for fail in (False, False, True):
        try:
            ref(x, fail)
        except ValueError:
            pass
    want = ref.cache.asnumpy()
    for round_ in range(5):
        _, net = twin(ms, raising_cache_net(ms))
        store = str(tmp_path / f"store{round_}")
        with prefetchd.Daemon(device_budget=weight_bytes(net) // 2, store_dir=store) as daemon:
            prefetchd.offload(net, daemon, lookahead=1)
            net(x)
            net(x)
            with pytest.raises(ValueError, match="the user's error"):
                net(x, True)
        with prefetchd.Daemon(device_budget="1MiB", store_dir=store) as again:
            cache = ms.Tensor(np.zeros((1, 256), np.float32))
            again.register_remote("cache", (1, 256), "float32", target=cache)
            with again.use([cache]):
                np.testing.assert_array_equal(cache.asnumpy(), want, err_msg=f"round {round_}")
