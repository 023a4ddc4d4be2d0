"""A host cache too small for a single-use trace keeps steps spread evenly along it
(prefetchd/core/spread.py, core/hostcache.py): the selection alone, then the cache's
admissions and drops against a fake backend, no threads."""
import random

from prefetchd.core import policy as policies
from prefetchd.core.hostcache import HostCache
from prefetchd.core.records import ManagedTensor
from prefetchd.core.registry import Registry
from prefetchd.core.spread import spread
from prefetchd.telemetry.stats import Stats

from .fake_backend import FakeBackend

KiB = 1 << 10


def test_everything_is_kept_when_it_fits():
    assert spread([3, 0, 5, 2], 10) == [0, 1, 2, 3]


def test_equal_steps_are_kept_every_nth():
    assert spread([1] * 16, 8) == list(range(1, 16, 2))
    assert spread([1] * 12, 4) == [2, 5, 8, 11]
    kept = spread([1] * 100, 37)
    assert len(kept) == 37
    gaps = {b - a for a, b in zip(kept, kept[1:])}
    assert gaps <= {2, 3}          # never two cached steps closer, or farther apart, than the share says


def test_kept_bytes_stay_within_capacity_and_one_step_of_the_even_share():
    rng = random.Random(0)
    for _ in range(300):
        sizes = [rng.choice((0, 1, 4, 64, 65)) * KiB for _ in range(rng.randrange(1, 40))]
        capacity = rng.randrange(0, sum(sizes) + 2)
        kept = set(spread(sizes, capacity))
        assert sum(sizes[i] for i in kept) <= capacity
        if sum(sizes) <= capacity:
            assert kept == set(range(len(sizes)))
            continue
        share, held, want = capacity / sum(sizes), 0, 0.0
        for i, size in enumerate(sizes):
            held += size if i in kept else 0
            want += share * size
            assert held <= want + 1e-6, (sizes, capacity, i)            # never ahead of the share
            assert want - held < max(sizes) + 1e-6, (sizes, capacity, i)  # at most a step behind


class Cache:
    """A HostCache over a fake backend: tensors of equal size, a Belady policy with a trace."""

    def __init__(self, n, host_units, unit=64 * KiB):
        self.backend = FakeBackend(device_budget=n * unit, host_budget=host_units * unit)
        self.registry = Registry("test")
        self.policy = policies.create("belady")
        self.stats = Stats()
        self.recs = [ManagedTensor(name=f"t{i}", shape=(unit,), dtype="uint8", nbytes=unit, remote_valid=True)
                     for i in range(n)]
        for rec in self.recs:
            self.registry.add(rec)
        self.cache = HostCache(self.backend, self.registry, self.policy, self.stats, host_units * unit)

    def load(self, i):
        """What Loads.start does for a disk read: admit, then fill a host replica."""
        rec = self.recs[i]
        self.policy.advance(i + 1)                    # step 0 is the (empty) root
        if rec.host_valid or not self.cache.admit(rec):
            return
        rec.host_block = self.backend.alloc_host(rec.nbytes)
        rec.host_valid = True

    def cached(self):
        return [i for i, r in enumerate(self.recs) if r.host_valid]


def test_a_single_use_trace_is_cached_spread_out_from_the_first_traced_pass_on():
    c = Cache(n=8, host_units=4)
    for i in range(8):           # no trace yet: LRU admits what fits, then churns
        c.load(i)
    c.policy.set_trace([[]] + [[r.name] for r in c.recs])
    for _ in range(3):
        for i in range(8):
            c.load(i)
        assert c.cached() == [1, 3, 5, 7]
        assert c.backend.host_used() <= c.backend.host_capacity()


def test_a_trace_that_uses_a_tensor_twice_keeps_beladys_choice():
    c = Cache(n=8, host_units=4)
    steps = [[]] + [[r.name] for r in c.recs] + [["t0"]]          # t0 is read again at the end
    c.policy.set_trace(steps)
    assert c.policy.single_use_steps() == []
    assert c.cache.spread() is None
    for i in range(8):
        c.load(i)
    assert c.cached() == [0, 1, 2, 3]     # Belady bypass: nothing later is reused sooner


def test_host_only_data_shrinks_what_is_spread():
    c = Cache(n=8, host_units=6)
    c.policy.set_trace([[]] + [[r.name] for r in c.recs])
    pinned = ManagedTensor(name="host-only", shape=(2 * 64 * KiB,), dtype="uint8", nbytes=2 * 64 * KiB,
                           host_valid=True)
    pinned.host_block = c.backend.alloc_host(pinned.nbytes)
    c.registry.add(pinned)
    _traced, kept = c.cache.spread()
    assert sorted(kept) == ["t1", "t3", "t5", "t7"]          # 4 units of room, not 6
    for _ in range(2):
        for i in range(8):
            c.load(i)
    assert c.cached() == [1, 3, 5, 7]
