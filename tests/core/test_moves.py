"""The scheduler core driven step by step: no threads, no I/O, a fake backend.

Each test builds a Scheduler over tests/core/fake_backend.py, submits requests
into its inbox, runs `step()` with completions it chooses, and checks the
residency invariants after every step.
"""
import errno
import random
import threading
from concurrent.futures import Future

import pytest

from prefetchd.config import Config
from prefetchd.core import policy as policies
from prefetchd.core.records import ManagedTensor, State
from prefetchd.core.registry import Registry
from prefetchd.core.requests import Kind, Request, settle
from prefetchd.core.scheduler import Scheduler
from prefetchd.errors import PrefetchdError, StorageError
from prefetchd.telemetry.stats import Stats

from .fake_backend import FakeBackend

KiB = 1 << 10


class Core:
    """A scheduler over a fake backend, with the daemon's submit/settle glue."""

    def __init__(self, device=64 * KiB, host=0, policy="belady", store_dir="/nonexistent/store"):
        self.config = Config(device_budget=device, host_budget=host, policy=policy, store_dir=store_dir)
        self.backend = FakeBackend(device, host)
        self.registry = Registry("test")
        self.policy = policies.create(policy)
        self.stats = Stats()
        self.lock = threading.Lock()
        self.s = Scheduler(self.config, self.backend, self.registry, self.policy, self.stats, self.lock,
                           emit=lambda *a, **k: None, guard=lambda rec: None, name="test")
        self.futures = []
        self.violations = []            # invariant 1 is checked at every reservation
        self.s.memory.reserve_checks.append(
            lambda used, high: used > high and self.violations.append((used, high)))

    def tensor(self, name, nbytes=4 * KiB, fill=None):
        rec = ManagedTensor(name=name, shape=(nbytes,), dtype="uint8", nbytes=nbytes, remote_valid=True)
        self.backend.store[name] = bytes([fill if fill is not None else len(self.registry) % 251]) * nbytes
        self.registry.add(rec)
        return rec

    def submit(self, kind, recs=(), **kw):
        req = Request(kind, tuple(recs) if recs is not None else None,
                      None if kind is Kind.UNPIN else Future(), **kw)
        req.seq = self.s.next_seq()
        self.s.inbox.append(req)
        if req.future is not None:
            self.futures.append(req.future)
        return req.future

    def step(self, pick=None):
        """Complete queued transfers (all, or those of the kinds in `pick`), then one step."""
        with self.lock:
            done = self.s.step(self.backend.complete(pick))
            settled = self.s.outcomes.take()
        for req, error in settled:
            settle(req, error, lambda recs: self.submit(Kind.UNPIN, recs))
        self.check()
        return done

    def drain(self, limit=100):
        for _ in range(limit):
            self.step()
            if not self.backend.queued and not self.s.inbox and not self.s.loads.queue:
                self.step()
                return
        raise AssertionError("the core did not settle")

    def check(self):
        assert not self.violations
        for rec in self.registry:
            if rec.pins:
                assert rec.state in (State.RESIDENT, State.STORING), rec
        # The index the memory and host cache count from is exactly the records in each state.
        assert self.registry.pinned == {r for r in self.registry if r.pins}
        assert self.registry.host_only == {r for r in self.registry
                                           if r.host_block is not None and not r.remote_valid}
        assert set(self.registry.droppable_host) == {r for r in self.registry if r.host_block is not None
                                                     and r.host_valid and r.remote_valid
                                                     and not r.reading_host}
        lru = list(self.registry.index.by_last_use())
        assert set(lru) == set(self.registry.droppable_host) and len(lru) == len(set(lru))
        assert [r.last_use for r in lru] == sorted(r.last_use for r in lru)


def test_prefetch_loads_and_pin_holds_until_unpinned():
    c = Core()
    a = c.tensor("a", fill=7)
    f = c.submit(Kind.PREFETCH, [a])
    c.step()
    assert a.state is State.LOADING and not f.done()
    c.step()
    assert a.state is State.RESIDENT and f.result(0) is None
    assert bytes(a.replica) == bytes([7]) * a.nbytes
    pin = c.submit(Kind.PIN, [a])
    c.step()
    assert pin.done() and a.pins == 1
    ev = c.submit(Kind.EVICT, [a])
    c.step()
    assert a.state is State.RESIDENT and isinstance(ev.exception(0), PrefetchdError)
    c.submit(Kind.UNPIN, [a])
    c.drain()
    assert c.submit(Kind.EVICT, [a]) and (c.drain() or True)
    assert a.state is State.ABSENT and c.backend.used == 0


def test_a_dirty_replica_is_dropped_only_after_a_verified_write_back():
    c = Core()
    a = c.tensor("a", fill=1)
    c.submit(Kind.PREFETCH, [a])
    c.drain()
    a.replica[:] = bytes([9]) * a.nbytes
    a.dirty, a.generation = True, 1
    ev = c.submit(Kind.EVICT, [a])
    c.step()
    assert a.state is State.STORING and not ev.done()
    c.step(pick={"store"})                       # written, not yet verified
    assert a.state is State.STORING and c.backend.store["a"] == bytes([9]) * a.nbytes
    c.drain()
    assert a.state is State.ABSENT and ev.result(0) is None and not a.dirty


def test_a_failed_write_back_keeps_the_replica_in_place_and_says_so():
    c = Core()
    a = c.tensor("a", fill=1)
    c.submit(Kind.PREFETCH, [a])
    c.drain()
    a.replica[:] = bytes([5]) * a.nbytes
    a.dirty, a.generation = True, 1
    c.backend.fail_next("store", errno.ENOSPC)
    ev = c.submit(Kind.EVICT, [a])
    c.drain()
    assert a.state is State.RESIDENT and a.writeback_failed and a.dirty
    assert isinstance(ev.exception(0), StorageError)
    assert bytes(a.replica) == bytes([5]) * a.nbytes        # nothing the user wrote was lost
    fl = c.submit(Kind.FLUSH, None)                          # the fault passed: flush retries
    c.drain()
    assert fl.result(0) is None and not a.dirty and c.backend.store["a"] == bytes([5]) * a.nbytes


@pytest.mark.parametrize("seed", range(6))
def test_watermark_and_pins_hold_under_random_steps(seed):
    rnd = random.Random(seed)
    c = Core(device=40 * KiB, policy=rnd.choice(["lru", "belady"]))
    recs = [c.tensor(f"t{i}", nbytes=rnd.choice([4, 8, 12]) * KiB) for i in range(12)]
    pinned = []
    for _ in range(300):
        op = rnd.random()
        if op < 0.35:
            c.submit(Kind.PREFETCH, rnd.sample(recs, rnd.randint(1, 2)), priority=rnd.randint(0, 3))
        elif op < 0.5 and len(pinned) < 2:
            rec = rnd.choice(recs)
            c.submit(Kind.PIN, [rec])
            pinned.append(rec)
        elif op < 0.6 and pinned:
            c.submit(Kind.UNPIN, [pinned.pop(rnd.randrange(len(pinned)))])
        elif op < 0.7:
            c.submit(Kind.EVICT, [rnd.choice(recs)])
        elif op < 0.75:
            rec = rnd.choice(recs)
            if rec.state is State.RESIDENT:
                rec.dirty, rec.generation = True, rec.generation + 1
        elif op < 0.8:
            c.submit(Kind.FLUSH, None)
        c.step(pick=None if rnd.random() < 0.7 else {rnd.choice(["load", "store", "verify"])})
    for rec in pinned:
        c.submit(Kind.UNPIN, [rec])
    c.drain()
    assert all(f.done() for f in c.futures)
    assert c.s.transfers.loads == 0 and not c.s.transfers
    assert all(r.state in (State.ABSENT, State.RESIDENT) for r in recs)


def _scenario(c):
    a, b, d = c.tensor("a"), c.tensor("b"), c.tensor("d")
    c.submit(Kind.PREFETCH, [a, b])
    c.step()
    c.submit(Kind.PIN, [d])
    c.step()
    a.dirty = True
    c.submit(Kind.EVICT, [a])
    c.submit(Kind.FLUSH, None)
    c.submit(Kind.WATERMARKS, (), args=(8 * KiB, 4 * KiB))
    c.step()
    c.submit(Kind.UNPIN, [d])
    c.drain()
    return a, b, d


def test_an_exception_at_every_backend_call_settles_every_future_and_leaves_usable_tensors():
    calls = _counted_calls()
    assert len(calls) > 8
    for k, method in enumerate(calls):
        c = Core(device=64 * KiB)
        c.backend.raise_at = k                     # the k-th call of the scenario raises
        recs = _scenario(c)
        assert all(f.done() for f in c.futures), f"a future hung with {method} failing"
        assert not c.s.transfers
        for rec in recs:
            assert rec.state in (State.ABSENT, State.RESIDENT), (method, rec)
        # Usable: each tensor can be made resident and evicted again.
        c.backend.raise_at = None
        c.submit(Kind.WATERMARKS, (), args=(60 * KiB, 50 * KiB))
        again = c.submit(Kind.PREFETCH, list(recs))
        c.drain()
        assert again.result(0) is None, method
        assert all(r.state is State.RESIDENT for r in recs)


def _counted_calls():
    c = Core(device=64 * KiB)
    _scenario(c)
    return list(c.backend.calls)


def test_host_cache_hits_match_the_trace_optimal_count_for_a_repeated_trace():
    n, capacity, cycles = 8, 3, 5
    c = Core(device=16 * KiB, host=capacity * 4 * KiB)
    recs = [c.tensor(f"t{i}") for i in range(n)]
    c.policy.set_trace([[r.name] for r in recs])
    hits = []
    for cycle in range(cycles):
        before = c.stats.loads_from["host"]
        for pos, rec in enumerate(recs):
            c.policy.advance(pos)
            c.submit(Kind.PIN, [rec])
            c.drain()
            c.submit(Kind.UNPIN, [rec])
            c.submit(Kind.EVICT, [rec])
            c.drain()
        hits.append(c.stats.loads_from["host"] - before)
    assert hits[0] == 0 and hits[1:] == [_belady_hits(n, capacity)] * (cycles - 1)
    assert c.backend.host_in_use <= c.backend.host_budget


def _belady_hits(n, capacity):
    """Hits per cycle of an optimal cache (Belady's MIN with bypass) on the cyclic
    sequence 0..n-1, in steady state: simulated, independently of prefetchd."""
    seq = list(range(n)) * 6
    cache, per_cycle = set(), []
    for i, item in enumerate(seq):
        if i % n == 0:
            per_cycle.append(0)
        if item in cache:
            per_cycle[-1] += 1
            continue

        def next_use(x, i=i):
            return next((j for j in range(i + 1, len(seq)) if seq[j] == x), float("inf"))
        if len(cache) < capacity:
            cache.add(item)
            continue
        far = max(cache, key=next_use)
        if next_use(far) > next_use(item):
            cache.remove(far)
            cache.add(item)
    return per_cycle[3]


def test_a_host_only_copy_is_never_dropped_for_the_cache():
    c = Core(device=16 * KiB, host=8 * KiB)
    only = c.tensor("only")
    only.remote_valid, only.host_valid = False, True          # register(tier="host")
    only.host_block = c.backend.alloc_host(only.nbytes)
    others = [c.tensor(f"t{i}") for i in range(4)]
    for rec in others:
        c.submit(Kind.PIN, [rec])
        c.drain()
        c.submit(Kind.UNPIN, [rec])
        c.submit(Kind.EVICT, [rec])
        c.drain()
    assert only.host_valid and only.host_block is not None
    assert c.backend.host_in_use <= c.backend.host_budget


@pytest.mark.parametrize("kind", ["load", "store", "verify"])
@pytest.mark.parametrize("nth", [0, 1, 2])
def test_an_exception_while_applying_a_completion_fails_its_request_and_settles_its_tensor(kind, nth):
    c = Core(device=64 * KiB)
    handlers = c.s._completions
    original, seen = handlers[kind], []

    def failing(rec, req, completion, seconds):
        seen.append(rec.name)
        if len(seen) == nth + 1:
            raise RuntimeError(f"injected failure applying {kind} #{nth}")
        return original(rec, req, completion, seconds)
    handlers[kind] = failing
    recs = _scenario(c)
    assert all(f.done() for f in c.futures)
    assert not c.s.transfers
    for rec in recs:
        assert rec.state in (State.ABSENT, State.RESIDENT), rec
    handlers[kind] = original
    c.submit(Kind.WATERMARKS, (), args=(60 * KiB, 50 * KiB))
    again = c.submit(Kind.PREFETCH, list(recs))
    c.drain()
    assert again.result(0) is None and all(r.state is State.RESIDENT for r in recs)


def test_a_prefetch_that_hits_keeps_its_tensor_from_later_prefetches():
    """The root unit's case (CI found it under load): the root is resident and
    unpinned at a pass end and its prefetch hits; then compute moves to step 0,
    where the root's next use looks farthest, before the pin for it arrives. A
    prefetch of the next unit must not evict what was asked for and not used yet."""
    c = Core(device=16 * KiB)
    root, a, b = c.tensor("root", 8 * KiB), c.tensor("a", 4 * KiB), c.tensor("b", 8 * KiB)
    c.policy.set_trace([[root.name], [a.name], [b.name]])
    c.submit(Kind.PIN, [root])
    c.drain()
    c.submit(Kind.UNPIN, [root])
    c.policy.advance(2)
    hit = c.submit(Kind.PREFETCH, [root])                  # the pass end: nearest next use
    c.drain()
    assert hit.result(0) is None and root.state is State.RESIDENT
    c.policy.advance(0)                                    # the next pass begins
    c.submit(Kind.PREFETCH, [a])
    c.submit(Kind.PREFETCH, [b])                           # does not fit beside root and a
    c.drain()
    assert root.state is State.RESIDENT, "a prefetch evicted a tensor prefetched and not used yet"
    pin = c.submit(Kind.PIN, [root])
    c.step()
    assert pin.done() and root.pins == 1


def test_a_demand_load_evicts_a_prefetched_tensor_only_for_room_it_needs_not_for_hysteresis():
    """A demand load crossing the high watermark evicts down to the low one, but the room
    beyond what the load needs never costs a tensor prefetched and not used yet: at a tight
    budget (an outside probe: interleaved parts at lookahead 1's minimum) that tensor is the
    next unit, which then missed under strict=True."""
    c = Core(device=64 * KiB)
    c.s.memory.high, c.s.memory.low = 36 * KiB, 12 * KiB
    old, nxt, now = c.tensor("old", 8 * KiB), c.tensor("next", 16 * KiB), c.tensor("now", 16 * KiB)
    c.policy.set_trace([[old.name], [now.name], [nxt.name]])
    c.submit(Kind.PREFETCH, [old])
    c.submit(Kind.PREFETCH, [nxt])                          # loaded ahead, not used yet
    c.drain()
    assert nxt.prefetched_unused and c.backend.used == 24 * KiB
    pin = c.submit(Kind.PIN, [now])                         # 24 + 16 > 36: room for 16 KiB
    c.drain()
    assert pin.done() and now.pins == 1
    assert old.state is State.ABSENT                        # the room it needed
    assert nxt.state is State.RESIDENT, "hysteresis evicted a prefetched tensor the load did not need gone"


def test_an_evict_that_meets_a_pin_on_arrival_drops_the_tensor_once_not_on_its_next_load():
    c = Core()
    a = c.tensor("a", fill=3)
    c.submit(Kind.PREFETCH, [a])
    c.step(pick=set())
    ev = c.submit(Kind.EVICT, [a])              # evict while loading ...
    c.step(pick=set())
    assert a.state is State.LOADING and a.evict_after_load
    pin = c.submit(Kind.PIN, [a])               # ... and compute pins it before it lands
    c.step(pick=set())
    c.step()
    assert pin.done() and a.pins == 1 and a.state is State.RESIDENT
    c.submit(Kind.UNPIN, [a])
    c.drain()
    assert ev.result(0) is None and a.state is State.ABSENT
    again = c.submit(Kind.PREFETCH, [a])        # an unrelated later load stays resident
    c.drain()
    assert again.result(0) is None and a.state is State.RESIDENT


def test_the_registry_indexes_pinned_host_only_and_droppable_host_records_through_every_change():
    c = Core(host=64 * KiB)
    a, b = c.tensor("a"), c.tensor("b")
    a.pins += 1
    a.pins += 1
    assert c.registry.pinned == {a}
    a.pins -= 1
    assert c.registry.pinned == {a}
    a.pins -= 1
    assert c.registry.pinned == set()
    b.host_block = object()                       # a host block, not filled yet: remote_valid still
    assert c.registry.host_only == set() and not c.registry.droppable_host
    b.host_valid = True                           # filled: a droppable cache of the remote copy
    assert list(c.registry.droppable_host) == [b]
    b.reading_host = True                         # a load reads it: not droppable meanwhile
    assert not c.registry.droppable_host
    b.reading_host = False
    assert list(c.registry.droppable_host) == [b]
    b.remote_valid = False                        # its remote copy is gone: host-only now
    assert c.registry.host_only == {b} and not c.registry.droppable_host
    b.host_block = None
    assert c.registry.host_only == set()
    loose = ManagedTensor(name="c", shape=(4,), dtype="uint8", nbytes=4, pins=1, host_block=object())
    c.registry.add(loose)                         # registered in those states: indexed at once
    assert c.registry.pinned == {loose} and c.registry.host_only == {loose}
    c.registry.forget(loose)
    assert c.registry.pinned == set() and c.registry.host_only == set()
    cached = ManagedTensor(name="d", shape=(4,), dtype="uint8", nbytes=4, host_block=object(),
                           host_valid=True, remote_valid=True)
    c.registry.add(cached)
    assert list(c.registry.droppable_host) == [cached]
    c.registry.forget(cached)
    assert not c.registry.droppable_host
    loose.pins = 0                                # forgotten: no longer indexed anywhere
    assert c.registry.pinned == set() and b.pins == 0


def test_the_droppable_host_replicas_come_least_recently_used_first_without_a_sort():
    c = Core(host=64 * KiB)
    recs = [c.tensor(f"t{i}") for i in range(6)]
    for i, r in enumerate(recs):
        r.last_use = 10 + i
        r.host_block, r.host_valid = object(), True
    index = c.registry.index
    assert list(index.by_last_use()) == recs
    recs[0].last_use = 99                  # used again: now the most recent
    recs[3].reading_host = True            # being read: not droppable meanwhile
    walk = index.by_last_use()
    assert [next(walk), next(walk)] == [recs[1], recs[2]]
    recs[1].host_block = None              # dropped while the walk is under way
    walk.close()                           # what was taken and not dropped stays indexed
    assert list(index.by_last_use()) == [recs[2], recs[4], recs[5], recs[0]]
    recs[3].reading_host = False
    assert list(index.by_last_use()) == [recs[2], recs[3], recs[4], recs[5], recs[0]]
    for _ in range(200):                   # many uses leave stale entries; the heap stays bounded
        recs[5].last_use += 1
    assert len(index._by_use) <= 2 * len(index.droppable_host) + 64
    assert list(index.by_last_use())[-1] is recs[5]
    walk = index.by_last_use()
    first = next(walk)                     # taken out of the heap while the walk is suspended
    for _ in range(200):                   # ... and a rebuild meanwhile indexes it again
        recs[4].last_use += 1
    walk.close()
    again = list(index.by_last_use())
    assert again[0] is first and len(again) == len(set(again)) == 5


def test_a_prefetch_of_a_tensor_a_watermark_eviction_is_writing_back_keeps_it():
    """A watermark eviction of a dirty tensor writes it back before the drop. A prefetch that
    arrives meanwhile counted as a hit, and the drop still followed: the tensor was gone
    when compute came for it (under strict=True a raise; seen after load_param_into_net,
    whose writes left the root weight dirty). The prefetch now keeps it: written back,
    clean, resident."""
    c = Core(device=64 * KiB)
    c.s.memory.high, c.s.memory.low = 24 * KiB, 8 * KiB
    a, e = c.tensor("a", 8 * KiB, fill=1), c.tensor("e", 8 * KiB, fill=2)
    b, d = c.tensor("b", 8 * KiB, fill=3), c.tensor("d", 8 * KiB, fill=4)
    c.submit(Kind.PIN, [b])                              # compute holds b throughout
    for rec in (a, e):                                   # a and e used: neither prefetched-unused
        c.submit(Kind.PIN, [rec])
        c.drain()
        c.submit(Kind.UNPIN, [rec])
        c.drain()
    a.replica[:] = bytes([9]) * a.nbytes
    a.dirty, a.generation = True, 1
    load = c.submit(Kind.PIN, [d])       # 24 + 8 > 24: down to the low watermark, a and e go
    c.step(pick=set())
    assert a.state is State.STORING and a.evict_after_store and e.state is State.ABSENT
    again = c.submit(Kind.PREFETCH, [a])                 # wanted again before its drop
    c.drain()
    assert again.result(0) is None and load.result(0) is None and d.pins == 1
    assert a.state is State.RESIDENT and not a.dirty, f"the prefetched tensor was dropped: {a.state}"
    assert c.backend.store["a"] == bytes([9]) * a.nbytes and bytes(a.replica) == bytes([9]) * a.nbytes
    assert c.backend.used == 24 * KiB


def test_an_explicit_evict_of_a_tensor_being_written_back_still_drops_it_after_a_prefetch():
    c = Core()
    a = c.tensor("a", fill=1)
    c.submit(Kind.PREFETCH, [a])
    c.drain()
    a.dirty, a.generation = True, 1
    ev = c.submit(Kind.EVICT, [a])
    c.step(pick=set())
    assert a.state is State.STORING
    c.submit(Kind.PREFETCH, [a])
    c.drain()
    assert ev.result(0) is None and a.state is State.ABSENT and c.backend.used == 0
