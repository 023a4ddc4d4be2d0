"""A user's own code around an offloaded model's units: forward hooks that read weights, a
unit whose raise the model catches, a cell that returns its own Parameter (found by an
outside probe on model code of its own)."""
import logging

import numpy as np
import pytest

import prefetchd
from prefetchd.errors import NotResidentError

D = 256


def _model(ms, raises=False):
    nn, ops = ms.nn, ms.ops

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(D, D)

        def construct(self, x):
            h = ops.tanh(self.fc(x))
            if raises and float(h.sum().asnumpy()) > 0:
                raise ValueError("this fast path does not take that input")
            return h

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([Block() for _ in range(6)])
            if raises:
                self.fallback = nn.CellList([nn.Dense(D, D) for _ in range(6)])

        def construct(self, x):
            for i, block in enumerate(self.blocks):
                if not raises:
                    x = block(x)
                    continue
                try:
                    x = block(x)
                except ValueError:            # the model's own recovery
                    x = ops.tanh(self.fallback[i](x))
            return x

    ms.set_seed(7)
    return Net()


def _inputs(ms, seed):
    return ms.Tensor(np.random.default_rng(seed).standard_normal((4, D)).astype(np.float32))


def _weight_bytes(model):
    return sum(p.nbytes for p in model.get_parameters())


def _norms(log, of_sub_cell=False):
    """A hook (or pre-hook) logging the norm of the hooked cell's weight, or of its `fc`'s."""
    from mindspore import ops

    def hook(cell, *args):              # a pre-hook (cell, inputs) or a hook (cell, inputs, output)
        log.append(float(ops.norm(cell.fc.weight).asnumpy()))

    def own_hook(cell, *args):
        log.append(float(ops.norm(cell.weight).asnumpy()))
    return hook if of_sub_cell else own_hook


def _register(cells, hook, pre):
    for cell in cells:
        (cell.register_forward_pre_hook if pre else cell.register_forward_hook)(hook)


@pytest.mark.parametrize("pre", [True, False], ids=["pre_hook", "hook"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_users_hook_on_a_unit_cell_reads_its_weight_pinned(ms, make_daemon, pre, when):
    """prefetchd's pin ran after a pre-hook registered before offload(), and its release
    before a hook registered after it: the hook's read of the weight was refused."""
    resident, offloaded = _model(ms), _model(ms)
    want_log, log = [], []
    _register([b.fc for b in resident.blocks], _norms(want_log), pre)
    xs = [_inputs(ms, i) for i in range(3)]
    want = [resident(x).asnumpy() for x in xs]
    daemon = make_daemon(device_budget=int(_weight_bytes(offloaded) * 0.4))
    if when == "before":
        _register([b.fc for b in offloaded.blocks], _norms(log), pre)
    handle = prefetchd.offload(offloaded, daemon, lookahead=1)
    if when == "after":
        _register([b.fc for b in offloaded.blocks], _norms(log), pre)
    assert "blocks.0.fc" in [u.name for u in handle.plan().units]       # the hooked cells are units
    for x, y in zip(xs, want):
        np.testing.assert_array_equal(offloaded(x).asnumpy(), y)
    assert log == want_log and len(log) == 18


@pytest.mark.parametrize("pre", [True, False], ids=["pre_hook", "hook"])
def test_a_hook_registered_before_offload_that_reads_a_sub_cells_weight_keeps_its_cell_whole(
        ms, make_daemon, pre):
    """A hook on a block reading block.fc.weight read it outside fc's call: refused at every
    forward. offload() now reads the hooks it finds like the construct; one registered after
    offload() is refused saying so."""
    resident, offloaded, late = _model(ms), _model(ms), _model(ms)
    want_log, log, late_log = [], [], []
    _register(resident.blocks, _norms(want_log, True), pre)
    x = _inputs(ms, 0)
    want = resident(x).asnumpy()
    daemon = make_daemon(device_budget=int(_weight_bytes(offloaded) * 0.4))
    _register(offloaded.blocks, _norms(log, True), pre)
    handle = prefetchd.offload(offloaded, daemon, lookahead=1)
    names = [u.name for u in handle.plan().units]
    assert "blocks.0" in names and "blocks.0.fc" not in names, names
    np.testing.assert_array_equal(offloaded(x).asnumpy(), want)
    assert log == want_log and len(log) == 6
    handle.close()

    handle = prefetchd.offload(late, daemon, lookahead=1)
    _register(late.blocks, _norms(late_log, True), pre)
    with pytest.raises(NotResidentError, match="registered after it"):
        late(x)


def test_a_unit_whose_raise_the_model_catches_is_released(ms, make_daemon):
    """A unit that raised stayed pinned until the pass ended (its release hook did not run),
    so at a budget that holds two units the fallbacks found no room (BudgetError naming the
    raised blocks), where a smaller budget worked."""
    resident, offloaded = _model(ms, raises=True), _model(ms, raises=True)
    xs = [_inputs(ms, i) for i in range(3)]
    want = [resident(x).asnumpy() for x in xs]
    daemon = make_daemon(device_budget=int(_weight_bytes(offloaded) * 0.3))
    prefetchd.offload(offloaded, daemon, lookahead=0)
    for x, y in zip(xs, want):
        np.testing.assert_array_equal(offloaded(x).asnumpy(), y)


def test_a_cell_returning_its_own_parameter_warns_that_writes_through_it_are_lost(ms, make_daemon, caplog):
    nn, ops = ms.nn, ms.ops

    class Layer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.q = nn.Dense(D, D)
            self.cache = ms.Parameter(ms.Tensor(np.zeros((4, D), np.float32)), name="cache",
                                      requires_grad=False)

        def construct(self, x):
            self.cache[0:1] = self.q(x)
            return ops.matmul(x, self.cache.T), self.cache

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([Layer() for _ in range(3)])

        def construct(self, x):
            caches = []
            for layer in self.layers:
                y, cache = layer(x)
                caches.append(cache)
            return y, caches

    model = Net()
    daemon = make_daemon(device_budget=int(_weight_bytes(model) * 1.5))
    prefetchd.offload(model, daemon, lookahead=1)
    with caplog.at_level(logging.WARNING, logger="prefetchd.hooks"):
        _, caches = model(ms.Tensor(np.ones((1, D), np.float32)))
    assert caches[0] is not model.layers[0].cache
    warned = [r.getMessage() for r in caplog.records if "returns its Parameter" in r.getMessage()]
    assert len(warned) == 3 and "'layers.0.cache'" in warned[0] and "does not reach the model" in warned[0]


def test_a_cells_own_method_as_its_hook_is_read_through_self_too(ms):
    """A block registering its own method as a forward hook (`self.register_forward_hook(
    self._log)`) reads its sub-cell's weight through `self`, not its cell argument."""
    from prefetchd.hooks.construct_reads import direct_reads
    nn, ops = ms.nn, ms.ops

    class Logged(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(4, 4)
            self.norms = []
            self.register_forward_hook(self._log)

        def _log(self, cell, inputs, output):
            self.norms.append(ops.norm(self.fc.weight))

        def construct(self, x):
            return self.fc(x)

    (read,) = direct_reads(Logged())
    assert read[0] == "self.fc.weight (in its forward hook Logged._log)", read
