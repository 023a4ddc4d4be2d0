"""A cell shared by several blocks (prefetchd/hooks/planner.py, _drop_shared).

One rotary-embedding cell that every decoder layer holds (`self.rot = rot`): with the
layers split into units, each layer's unit listed `rot`, but a cell's hooks can pin one
unit only, so every other layer's unit waited for a call of `rot` that never came and
stayed pinned until the pass ended; the first forward failed with BudgetError. Now the
shared cell is left out of every unit and its weights are pinned in the root.
"""
import numpy as np

import prefetchd

D, FF = 128, 512


def model(ms, shared):
    nn = ms.nn

    class Rotary(nn.Cell):
        def __init__(self):
            super().__init__()
            table = np.cos(np.arange(64 * D, dtype=np.float32).reshape(64, D) / 7.0)
            self.cos_cached = ms.Parameter(ms.Tensor(table), "cos_cached", requires_grad=False)

        def construct(self, n):
            return self.cos_cached[:n]

    class Block(nn.Cell):
        def __init__(self, rot):
            super().__init__()
            self.fc1, self.fc2, self.rot = nn.Dense(D, FF), nn.Dense(FF, D), rot

        def construct(self, x):
            return x + self.fc2(self.fc1(x * self.rot(x.shape[1])))

    class Decoder(nn.Cell):
        def __init__(self):
            super().__init__()
            rot = Rotary()
            self.layers = nn.CellList([Block(rot if shared else Rotary()) for _ in range(6)])

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    ms.set_seed(0)
    net = Decoder()
    net.set_train(False)
    return net


def test_a_cell_every_block_shares_is_pinned_in_the_root_and_the_layers_stream(ms, make_daemon):
    net = model(ms, shared=True)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 8, D)).astype(np.float32))
    want = net(x).asnumpy()
    weights = sum(p.asnumpy().nbytes for p in net.get_parameters())   # the table counted once
    handle = prefetchd.offload(net, make_daemon(device_budget=int(weights * 0.47)), lookahead=1)
    plan = handle.plan()
    rot = net.layers[0].rot
    assert len(plan.units) == 12 and not any(cell is rot for u in plan.units for _, cell in u.cells)
    assert [p.name for p in plan.root.params] == [rot.cos_cached.name]
    for i in range(3):
        np.testing.assert_array_equal(net(x).asnumpy(), want, err_msg=f"pass {i}")
    handle.close()


def test_cells_that_are_not_shared_stay_in_their_blocks_units(ms):
    from prefetchd.hooks.planner import plan_units
    net = model(ms, shared=False)
    plan = plan_units(net, 1_200_000, 1)
    assert not plan.root.params
    assert any(name.endswith(".rot") for u in plan.units for name, _ in u.cells)


def test_units_given_around_a_shared_cell_also_called_alone_stream_at_the_smallest_budget(ms, make_daemon):
    """units= makes each layer a unit around a Dense every layer shares, which the model also
    calls alone after the layers. The recording pass made that lone call an entry of the
    unit the shared cell is named under (layers.0); afterwards each call of the shared cell
    inside another layer's unit pinned layers.0 as well, two units at once: BudgetError at
    lookahead 0 on the budget offload() accepted, and a resync per call on a larger one."""
    nn, ops = ms.nn, ms.ops

    class Layer(nn.Cell):
        def __init__(self, shared):
            super().__init__()
            self.fc1, self.fc2 = nn.Dense(D, D), shared

        def construct(self, x):
            return self.fc2(ops.tanh(self.fc1(x))) * 0.5 + x

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            shared = nn.Dense(D, D)
            self.layers = nn.CellList([Layer(shared) for _ in range(4)])
            self.head = nn.Dense(D, 2 * D)

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            x = self.layers[1].fc2(x)        # the shared cell alone, under another layer's name
            return self.head(self.layers[3].fc1(x))

    ms.set_seed(0)
    net = Net()
    net.set_train(False)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, D)).astype(np.float32))
    want = net(x).asnumpy()
    layer_bytes = 2 * (D * D + D) * 4
    units = [f"layers.{i}" for i in range(4)] + ["head"]
    daemon = make_daemon(device_budget=int(layer_bytes * 1.15))   # one unit at a time, not two
    handle = prefetchd.offload(net, daemon, lookahead=0, units=units)
    for i in range(4):
        np.testing.assert_array_equal(net(x).asnumpy(), want, err_msg=f"pass {i}")
    stats = handle.stats()
    assert stats["resyncs"] == 0 and stats["misses"] == 0, stats
    status = daemon.status()["device"]
    assert status["peak"] <= status["high_watermark"], status
    handle.close()
