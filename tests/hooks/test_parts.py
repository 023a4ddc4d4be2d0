"""Units whose own cell is never called, only its parts (prefetchd/hooks/parts.py).

A backbone whose stem and stages the model calls one by one, a plain holder of
sub-cells: with the holder planned as one unit, nothing pinned it and its
weights were read unmapped (the process died on the first forward, at any
budget). Every pass must equal the resident model, with no miss and no resync.
"""
import numpy as np
import pytest

import prefetchd
from prefetchd.hooks.planner import param_nbytes

H = 256
PASSES = 3


def classes(ms):
    nn, ops = ms.nn, ms.ops

    class Stage(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Dense(H, H), nn.Dense(H, H)

        def construct(self, x):
            return self.b(ops.relu(self.a(x)))

    class Backbone(nn.Cell):
        """A holder: models call its parts, never it."""
        def __init__(self):
            super().__init__()
            self.stem = nn.Dense(H, H)
            self.stages = nn.CellList([Stage() for _ in range(3)])
            self.extra = nn.Dense(H, H)

        def construct(self, x):
            raise RuntimeError("a holder is never called")

    class Holders(nn.Cell):
        """Calls each holder's stem and stages; `extra` only when asked to."""
        def __init__(self, n=4):
            super().__init__()
            self.blocks = nn.CellList([Backbone() for _ in range(n)])
            self.head = nn.Dense(H, 8)
            self.use_extra = False

        def construct(self, x):
            for bb in self.blocks:
                x = bb.stem(x)
                for stage in bb.stages:
                    x = stage(x)
            if self.use_extra:               # after all blocks: the first ones are evicted by then
                for bb in self.blocks:
                    x = bb.extra(x)
            return self.head(x)

    class Pyramid(nn.Cell):
        """FPN-style: every stage's output is kept and all are read at the end."""
        def __init__(self):
            super().__init__()
            self.backbones = nn.CellList([Backbone() for _ in range(2)])
            self.lateral = nn.Dense(H, H)

        def construct(self, x):
            features = []
            for backbone in self.backbones:
                x = backbone.stem(x)
                for stage in backbone.stages:
                    x = stage(x)
                    features.append(x)
            out = self.lateral(features[0])
            for f in features[1:]:
                out = out + self.lateral(f)
            return out

    class DeepParts(nn.Cell):
        """Calls parts two levels down, and a stage whole, of each holder."""
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([Backbone() for _ in range(3)])

        def construct(self, x):
            for bb in self.blocks:
                x = bb.stages[0].a(x)
                x = bb.stages[0].b(ops.tanh(x))
                x = bb.stages[2](x)
            return x

    return Holders, Pyramid, DeepParts, Stage


def weight_bytes(model):
    return sum(param_nbytes(p) for p in {id(p): p for p in model.get_parameters()}.values())


def stream(ms, model, x, store_dir, fraction, between_passes=None):
    """Offload at `fraction` of the weights; every pass equal to resident. Returns the handle's
    plan and stats (the daemon is closed)."""
    model.set_train(False)
    want = [model(x).asnumpy()]
    with prefetchd.Daemon(device_budget=int(weight_bytes(model) * fraction), store_dir=store_dir) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        for i in range(PASSES):
            np.testing.assert_array_equal(model(x).asnumpy(), want[0], err_msg=f"pass {i}")
        if between_passes is not None:
            between_passes(model)
            model.set_train(False)
        stats, plan = handle.stats(), handle.plan()
        handle.close()
    return plan, stats


@pytest.fixture
def x(ms):
    return ms.Tensor(np.random.default_rng(0).standard_normal((2, H)).astype(np.float32))


@pytest.mark.parametrize("fraction", [0.8, 3.0])
def test_holder_units_are_pinned_from_their_parts_calls(ms, x, tmp_path, fraction):
    Holders, _, _, _ = classes(ms)
    ms.set_seed(0)
    plan, stats = stream(ms, Holders(), x, str(tmp_path / "store"), fraction)
    # The case under test: each holder is one unit (it fits its share).
    assert [type(cell).__name__ for u in plan.units for _, cell in u.cells] == ["Backbone"] * 4
    assert stats["misses"] == 0 and stats["resyncs"] == 0, stats
    assert stats["trace"] == 5


def test_a_holders_part_first_called_in_a_later_pass_is_fetched_not_read_unmapped(ms, x, tmp_path):
    Holders, _, _, _ = classes(ms)
    ms.set_seed(0)
    model = Holders()
    ms.set_seed(0)
    resident = Holders()                 # the same weights, never offloaded
    model.set_train(False)
    resident.set_train(False)
    np.testing.assert_array_equal(model(x).asnumpy(), resident(x).asnumpy())
    resident.use_extra = True
    want = resident(x).asnumpy()
    with prefetchd.Daemon(device_budget=int(weight_bytes(model) * 0.8), store_dir=str(tmp_path / "s")) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        model(x)
        model(x)                         # recorded and streamed without `extra`
        model.use_extra = True           # now every holder's `extra` runs, after all blocks
        for i in range(2):
            np.testing.assert_array_equal(model(x).asnumpy(), want, err_msg=f"pass {i} with extra")
        handle.close()


@pytest.mark.parametrize("layout, fraction, holders", [(1, 2.0, 2), (2, 1.2, 3)], ids=["pyramid", "deep_parts"])
def test_holders_whose_outputs_are_kept_or_whose_parts_are_called_two_levels_down(ms, x, tmp_path, layout,
                                                                                 fraction, holders):
    """Pyramid: every stage's output is kept across the holder's release and read at the end.
    DeepParts: parts two levels down are called, and a stage whole."""
    model = classes(ms)[layout]
    ms.set_seed(0)
    plan, stats = stream(ms, model(), x, str(tmp_path / "store"), fraction)
    assert [type(cell).__name__ for u in plan.units for _, cell in u.cells] == ["Backbone"] * holders
    assert stats["misses"] == 0 and stats["resyncs"] == 0, stats


def test_after_the_recording_pass_parts_keep_only_a_pre_probe(ms, x, tmp_path):
    _, _, _, Stage = classes(ms)
    ms.set_seed(0)
    model = ms.nn.SequentialCell([Stage() for _ in range(4)])
    model.set_train(False)
    with prefetchd.Daemon(device_budget=int(weight_bytes(model) * 1.2), store_dir=str(tmp_path / "s")) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        assert [cell for u in handle.plan().units for _, cell in u.cells] == list(model)
        parts = [cell for block in model for cell in (block.a, block.b)]
        assert all(cell._forward_pre_hook and cell._forward_hook for cell in parts)   # recording
        model(x)
        assert all(len(cell._forward_pre_hook) == 1 and not cell._forward_hook for cell in parts)
        handle.close()
        assert not any(cell._forward_pre_hook for cell in parts)


def test_a_part_called_alone_after_its_units_own_cell_ran_in_the_recording_pass(ms, x, tmp_path):
    """Each block runs whole; in later passes the model also calls the third block's `a`
    alone after the last block (its unit evicted by then): it was read unmapped (SIGSEGV)."""
    _, _, _, Stage = classes(ms)
    nn = ms.nn

    class Revisits(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([Stage() for _ in range(6)])
            self.revisit = None           # a callable the construct cannot be read through

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            if self.revisit is not None:
                x = self.revisit(x)
            return x

    ms.set_seed(0)
    model = Revisits()
    model.set_train(False)
    first_a = model.blocks[2].a
    model.revisit = lambda v: first_a(v)
    want = model(x).asnumpy()
    model.revisit = None
    with prefetchd.Daemon(device_budget=int(weight_bytes(model) * 0.55), store_dir=str(tmp_path / "s")) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        assert [cell for u in handle.plan().units for _, cell in u.cells] == list(model.blocks)
        model(x)
        model(x)
        model.revisit = lambda v: first_a(v)
        for i in range(2):
            np.testing.assert_array_equal(model(x).asnumpy(), want, err_msg=f"pass {i} revisiting")
        handle.close()


def test_a_pass_that_runs_no_unit_is_not_an_error_and_the_next_one_records(ms, x, tmp_path):
    """An embeddings-only call (every block skipped) reads no unit's weights. It raised
    'none of its unit hooks fired - it is compiled' and lost the output."""
    _, _, _, Stage = classes(ms)
    nn = ms.nn

    class Skippable(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed, self.blocks, self.skip = nn.Dense(H, H), nn.CellList([Stage() for _ in range(4)]), True

        def construct(self, x):
            x = self.embed(x)
            if not self.skip:
                for block in self.blocks:
                    x = block(x)
            return x

    ms.set_seed(0)
    model = Skippable()
    model.set_train(False)
    want_skipped = model(x).asnumpy()
    model.skip = False
    want_full = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=int(weight_bytes(model) * 0.8), store_dir=str(tmp_path / "s")) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        for skip in (True, False, False, True, False):
            model.skip = skip
            np.testing.assert_array_equal(model(x).asnumpy(), want_skipped if skip else want_full)
        stats = handle.stats()
        assert stats["trace"] == len(handle.plan().units) + 1           # recorded by the first full pass
        assert stats["misses"] == 0
        handle.close()


@pytest.mark.parametrize("lookahead", [0, "auto"])
def test_a_unit_whose_part_runs_alone_again_is_released_when_the_next_unit_starts(ms, tmp_path, lookahead):
    """After the blocks the model calls the first block's `b` again, then a head that fits
    the budget only alone. That call pins the first block's unit (an entry of it since the
    recording pass), whose other cell does not run again: it stayed pinned to the pass
    end, and every streamed pass failed with BudgetError at the head (probe J). It is
    released once the head starts, like a unit pinned by a part's call."""
    _, _, _, Stage = classes(ms)
    nn = ms.nn

    class Again(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([Stage() for _ in range(3)])
            self.head = nn.Dense(H, 4 * H)

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(self.blocks[0].b(x))

    ms.set_seed(0)
    model = Again()
    model.set_train(False)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, H)).astype(np.float32))
    want = model(x).asnumpy()
    # Room for the head and half a block: never for the head beside a pinned block.
    budget = int((weight_bytes(model.head) + weight_bytes(model.blocks[0]) // 2) / 0.95)
    with prefetchd.Daemon(device_budget=budget, store_dir=str(tmp_path / "s")) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=lookahead)
        assert [cell for u in handle.plan().units for _, cell in u.cells] == [*model.blocks, model.head]
        for i in range(PASSES):
            np.testing.assert_array_equal(model(x).asnumpy(), want, err_msg=f"pass {i}")
        status = daemon.status()
        assert status["device"]["peak"] <= status["device"]["high_watermark"], status
        handle.close()


def test_units_entered_by_parts_after_the_blocks_leave_room_for_the_next_prefetch(ms, tmp_path):
    """After the blocks the model calls the first block's `b`, then the third block's `a`,
    then a head that fits beside one block only, at lookahead 1 with strict=True. Since
    the recording pass those calls are entries of their blocks' units. The first block's
    unit, pinned by its entry, stayed pinned while the third's fit beside it, so the head
    was never prefetched: strict=True raised at the head on every streamed pass (probe K).
    Pinned by an entry, a unit is done once the next unit starts, as while recording."""
    _, _, _, Stage = classes(ms)
    nn = ms.nn

    class Again(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([Stage() for _ in range(4)])
            self.head = nn.Dense(H, 3 * H)

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(self.blocks[2].a(self.blocks[0].b(x)))

    ms.set_seed(0)
    model = Again()
    model.set_train(False)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, H)).astype(np.float32))
    want = model(x).asnumpy()
    budget = int((weight_bytes(model.head) + weight_bytes(model.blocks[0])) * 1.1)
    with prefetchd.Daemon(device_budget=budget, store_dir=str(tmp_path / "s")) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1, strict=True,
                                   units=[f"blocks.{i}" for i in range(4)] + ["head"])
        for i in range(5):
            np.testing.assert_array_equal(model(x).asnumpy(), want, err_msg=f"pass {i}")
        stats = handle.stats()
        assert stats["misses"] == 0 and stats["resyncs"] == 0, stats
        handle.close()
