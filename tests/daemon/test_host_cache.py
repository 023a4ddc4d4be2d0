"""Host RAM as a cache of the remote tier, seen the way a user sees it: a model of their own
(not prefetchd's), `Daemon(host_budget=...)`, `offload()`, forwards, and `daemon.status()`.

The core's policy (Belady on the trace, LRU without one, dirty replicas written back before
a drop) is tested without threads in tests/core/test_moves.py; here the whole path runs:
disk reads through O_DIRECT, host replicas, copies to the device, and the layer hooks."""
import numpy as np
import pytest

import prefetchd
from _block_net import BLOCKS, HIDDEN, UNIT_BLOCKS, Net

TENSORS = 2 * BLOCKS


def build(ms):
    ms.set_seed(0)
    return Net()


@pytest.fixture
def case(ms):
    x = ms.Tensor(np.random.default_rng(1).standard_normal((4, HIDDEN), dtype=np.float32))
    return x, build(ms)(x).asnumpy()


def passes(model, daemon, x, want, n):
    """Run n forwards; per pass (outputs equal to the resident model's, status, load stats)."""
    out = []
    for _ in range(n):
        equal = np.array_equal(model(x).asnumpy(), want)
        status, stats = daemon.snapshot()
        out.append((equal, status, stats))
    return out


def test_a_model_the_host_budget_covers_reads_the_disk_once(ms, make_daemon, case):
    x, want = case
    daemon = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget="64MiB")
    model = build(ms)
    prefetchd.offload(model, daemon, lookahead=1)
    model_bytes = sum(r["nbytes"] for r in daemon.tensors("blocks.*"))
    runs = passes(model, daemon, x, want, 5)
    assert all(equal for equal, _, _ in runs)
    first_status, first_stats = runs[0][1], runs[0][2]
    # The first pass reads every tensor from disk once, leaving a host replica of each...
    assert first_status["loads_from"]["remote"] == TENSORS
    assert first_status["load_bytes_from"]["remote"] == model_bytes == first_stats.transfer_bytes["load"]
    assert first_status["host"]["cached"] == TENSORS and first_status["host"]["cached_bytes"] == model_bytes
    # ...and later passes never read the disk again: every device load copies from RAM.
    for _, status, stats in runs[1:]:
        assert stats.transfer_bytes["load"] == model_bytes
        assert status["loads_from"]["remote"] == TENSORS
        assert status["load_bytes_from"]["remote"] == model_bytes
        assert status["host"]["used"] <= status["host"]["budget"]
    assert runs[-1][1]["loads_from"]["host"] > runs[1][1]["loads_from"]["host"] > 0
    assert [r["tiers"] for r in daemon.tensors("blocks.0.*")][0].count("host") == 1


def test_a_host_budget_smaller_than_the_model_caches_part_and_stays_within_it(ms, make_daemon, case):
    x, want = case
    budget = 3 * UNIT_BLOCKS
    daemon = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget=budget)
    model = build(ms)
    prefetchd.offload(model, daemon, lookahead=1)
    runs = passes(model, daemon, x, want, 5)
    assert all(equal for equal, _, _ in runs)
    for _, status, _ in runs:
        assert status["host"]["used"] <= budget and status["host"]["cached_bytes"] <= budget
    (_, before, _), (_, after, _) = runs[1], runs[-1]
    # The disk is still read (the model does not fit the host budget), and RAM serves part.
    assert after["loads_from"]["remote"] > before["loads_from"]["remote"]
    assert after["loads_from"]["host"] > before["loads_from"]["host"]
    assert 0 < after["host"]["cached"] < TENSORS


def test_a_host_budget_for_half_the_model_caches_every_other_block(ms, make_daemon, case):
    """core/spread.py: the cached blocks alternate with the ones read from disk, so each
    disk read has a cached block's compute beside it; and they stay put, pass after pass."""
    x, want = case
    daemon = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget=BLOCKS // 2 * UNIT_BLOCKS)
    model = build(ms)
    prefetchd.offload(model, daemon, lookahead=1)

    def cached_blocks():
        return [i for i in range(BLOCKS)
                if all("host" in r["tiers"] for r in daemon.tensors(f"blocks.{i}.*"))]

    runs = passes(model, daemon, x, want, 3)          # record, then the first traced pass moves it
    cached = cached_blocks()
    assert cached == list(range(1, BLOCKS, 2))
    for equal, status, _ in runs + passes(model, daemon, x, want, 2):
        assert equal and status["host"]["used"] <= status["host"]["budget"]
        assert cached_blocks() == cached
    drops = daemon.snapshot()[1].host_drops
    before = daemon.status()["loads_from"]
    passes(model, daemon, x, want, 2)
    # Steady: the other half still comes from disk, and no cached replica is dropped for it.
    after = daemon.status()["loads_from"]
    assert after["remote"] > before["remote"] and after["host"] > before["host"]
    assert daemon.snapshot()[1].host_drops == drops


def test_a_weight_changed_under_a_host_cache_too_small_for_the_model_is_not_lost(ms, make_daemon, case):
    """A dirty replica must be written back before its host copy can be dropped: with the
    host budget far below the model, every pass drops host replicas, and the changed weight
    must still be the one computed with, pass after pass."""
    x, _ = case
    reference = build(ms)
    new_weight = np.full((HIDDEN, HIDDEN), 0.01, np.float32)
    reference.blocks[3].fc.weight.set_data(ms.Tensor(new_weight))
    want = reference(x).asnumpy()
    daemon = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget=2 * UNIT_BLOCKS)
    model = build(ms)
    prefetchd.offload(model, daemon, lookahead=1)
    model(x)
    weight = model.blocks[3].fc.weight
    with daemon.use([weight]):
        weight.set_data(ms.Tensor(new_weight))
    written_before = daemon.snapshot()[1].writebacks
    runs = passes(model, daemon, x, want, 4)
    assert all(equal for equal, _, _ in runs)
    stats = runs[-1][2]
    assert stats.host_drops > 0                       # replicas were dropped for room...
    assert stats.writebacks > written_before          # ...and the changed weight was written back
    # And it reads back as the new value outside a forward.
    with daemon.use([weight]):
        np.testing.assert_array_equal(weight.asnumpy(), new_weight)


def test_host_tier_weights_the_host_budget_cannot_hold_are_refused_with_nothing_registered(
        ms, make_daemon, case, tmp_path):
    """Staged one by one, they stopped at the first that did not fit: the earlier ones stayed
    managed, the model refused to run, and no other daemon could take it."""
    x, want = case
    small = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget=4 * UNIT_BLOCKS)
    model = build(ms)
    with pytest.raises(prefetchd.BudgetError, match=r"tier='host'.*16 parameters need \d+ bytes.*"
                                                    r"nothing was registered"):
        prefetchd.offload(model, small, lookahead=1, tier="host")
    assert small.names() == [] and small.status()["host"]["used"] == 0
    np.testing.assert_array_equal(model(x).asnumpy(), want)          # still the user's, resident
    (tmp_path / "other").mkdir()
    roomy = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget="64MiB", store_dir=str(tmp_path / "other"))
    prefetchd.offload(model, roomy, lookahead=1, tier="host")
    np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert roomy.status()["loads_from"]["remote"] == 0
