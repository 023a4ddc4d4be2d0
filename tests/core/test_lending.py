"""Host blocks lent to the device tier (core/lending.py), driven step by step.

The fake backend's `lending = True` models the cpu backend's page moves: a load
moves the bytes under the home (attach_lent) and leaves zeros in the host block,
the drop moves them back (detach_lent). So a core that read a lent host block, or freed pages it
should have returned, would load zeros: every check below compares bytes.
"""
import random

import pytest

from prefetchd.core.records import State
from prefetchd.core.requests import Kind

from .fake_backend import Home
from .test_moves import KiB, Core


def _lending_core(device=64 * KiB, host=64 * KiB, parks=False, **kw):
    c = Core(device=device, host=host, **kw)
    c.backend.lending = True
    c.backend.parks = parks
    return c


def _tensor(c, name, fill, nbytes=4 * KiB):
    rec = c.tensor(name, nbytes=nbytes, fill=fill)
    rec.home = Home()
    return rec


def _host_only(c, name, fill, nbytes=4 * KiB):
    """register(tier="host"): the host block is the only copy."""
    rec = _tensor(c, name, fill, nbytes)
    del c.backend.store[name]
    rec.remote_valid, rec.host_valid = False, True
    rec.host_block = c.backend.alloc_host(nbytes)
    rec.host_block[:] = bytes([fill]) * nbytes
    return rec


def _load(c, rec):
    f = c.submit(Kind.PREFETCH, [rec])
    c.drain()
    assert f.result(0) is None


def _drop(c, rec):
    """An eviction to make room (not an explicit evict, which fences at once)."""
    with c.lock:
        c.s.writebacks.evict(rec, "watermark")


def _evict(c, rec):
    f = c.submit(Kind.EVICT, [rec])
    c.drain()
    assert f.result(0) is None


def test_a_host_load_moves_the_bytes_and_the_drop_moves_them_back():
    c = _lending_core()
    a = _host_only(c, "a", fill=3)
    host = a.host_block
    _load(c, a)
    assert a.state is State.RESIDENT and a.host_lent
    assert bytes(a.replica) == bytes([3]) * a.nbytes
    assert bytes(host) == bytes(a.nbytes)             # moved, not copied: the host block is empty
    assert c.stats.moved_bytes == a.nbytes and c.stats.copied_bytes == 0
    assert c.backend.host_in_use == a.nbytes          # its slot stays counted in the host budget
    _evict(c, a)
    assert a.state is State.ABSENT and not a.host_lent and a.host_block is host
    assert bytes(host) == bytes([3]) * a.nbytes       # the same block holds the bytes again
    assert c.stats.returned_bytes == a.nbytes
    _load(c, a)                                        # and loads from it again
    assert bytes(a.replica) == bytes([3]) * a.nbytes


def test_without_lending_the_host_load_copies_and_the_host_replica_keeps_its_bytes():
    c = Core(device=64 * KiB, host=64 * KiB)            # the accelerator backends: DMA copies
    a = _host_only(c, "a", fill=4)
    _load(c, a)
    assert not a.host_lent and bytes(a.host_block) == bytes([4]) * a.nbytes
    assert c.stats.copied_bytes == a.nbytes and c.stats.moved_bytes == 0


def test_a_lent_replica_the_host_cache_drops_is_freed_with_the_device_block():
    c = _lending_core(device=64 * KiB, host=4 * KiB, policy="lru")
    a, b = _tensor(c, "a", fill=1), _tensor(c, "b", fill=2)
    _load(c, a)                                        # disk -> host block -> pages moved under a
    assert a.host_lent and a.host_valid
    _evict(c, a)
    _load(c, a)                                        # from the host tier now: lent again
    assert a.host_lent and c.stats.loads_from["host"] == 1
    _load(c, b)                                        # LRU: b's replica displaces a's lent one
    assert not a.host_valid and a.host_block is None and not a.host_lent
    assert bytes(a.replica) == bytes([1]) * a.nbytes   # the pages stayed under the device replica
    _evict(c, a)
    assert c.backend.host_in_use <= c.backend.host_budget
    _load(c, a)                                        # from disk again, same bytes
    assert bytes(a.replica) == bytes([1]) * a.nbytes


def test_a_written_lent_replica_is_written_back_and_the_new_bytes_go_back_to_the_host():
    c = _lending_core()
    a = _host_only(c, "a", fill=5)
    host = a.host_block
    _load(c, a)
    a.replica[:] = bytes([9]) * a.nbytes               # compute writes the weight in place
    a.home.written = True
    _evict(c, a)
    assert c.backend.store["a"] == bytes([9]) * a.nbytes   # written back before the drop
    assert a.state is State.ABSENT and not a.dirty and a.host_block is host
    assert bytes(host) == bytes([9]) * a.nbytes
    _load(c, a)
    assert bytes(a.replica) == bytes([9]) * a.nbytes


def test_a_failed_write_back_of_a_lent_replica_loses_nothing():
    c = _lending_core()
    a = _host_only(c, "a", fill=5)
    _load(c, a)
    a.replica[:] = bytes([8]) * a.nbytes
    a.home.written = True
    c.backend.fail_next("store")
    f = c.submit(Kind.EVICT, [a])
    c.drain()
    assert f.exception(0) is not None
    assert a.state is State.RESIDENT and a.dirty and a.writeback_failed and a.host_lent
    assert bytes(a.replica) == bytes([8]) * a.nbytes
    flush = c.submit(Kind.FLUSH, None)
    c.drain()
    assert flush.result(0) is None
    _evict(c, a)
    assert bytes(a.host_block) == bytes([8]) * a.nbytes and c.backend.store["a"] == bytes([8]) * a.nbytes


def test_a_host_load_and_its_drop_are_one_page_move_each():
    c = _lending_core()
    a = _host_only(c, "a", fill=2)
    _load(c, a)
    _evict(c, a)
    moves = [m for m in c.backend.calls if m in ("attach", "detach", "attach_lent", "detach_lent",
                                                    "fill_from_host")]
    assert moves == ["attach_lent", "detach_lent"]
    assert c.stats.page_moves == 2


def test_a_move_the_kernel_refuses_fails_the_load_and_the_host_replica_keeps_its_bytes():
    c = _lending_core()
    a = _host_only(c, "a", fill=6)
    real, calls = c.backend.attach_lent, []

    def attach_lent(home, block, host_block):
        calls.append(home)
        if len(calls) == 1:
            raise RuntimeError("injected: the kernel refused the move")
        real(home, block, host_block)
    c.backend.attach_lent = attach_lent
    f = c.submit(Kind.PREFETCH, [a])
    c.drain()
    assert "the kernel refused the move" in str(f.exception(0)) and a.state is State.ABSENT
    assert not a.host_lent and bytes(a.host_block) == bytes([6]) * a.nbytes
    assert c.backend.used == 0 and a.home.block is None
    _load(c, a)
    assert bytes(a.replica) == bytes([6]) * a.nbytes


def test_a_failure_after_the_move_gives_the_pages_back_to_the_host_block():
    c = _lending_core()
    a = _host_only(c, "a", fill=7)
    real, calls = c.s.loads.arrived, []

    def arrived(rec):
        calls.append(rec)
        if len(calls) == 1:
            raise RuntimeError("injected: completing the load broke")
        real(rec)
    c.s.loads.arrived = arrived
    f = c.submit(Kind.PREFETCH, [a])
    c.drain()
    assert f.exception(0) is not None and a.state is State.ABSENT
    assert not a.host_lent and a.home.block is None
    assert bytes(a.host_block) == bytes([7]) * a.nbytes   # the pages went back, not freed
    assert c.backend.used == 0
    _load(c, a)
    assert bytes(a.replica) == bytes([7]) * a.nbytes


# ---------------------------------------------------------------- parking (the cpu drop)
def _moves(c):
    return [m for m in c.backend.calls if m in ("attach", "detach", "attach_lent", "detach_lent",
                                                "park", "attach_parked", "unpark", "fill_from_host")]


def test_a_parked_drop_leaves_the_bytes_at_the_home_and_the_next_load_unparks_them():
    c = _lending_core(parks=True)
    a = _host_only(c, "a", fill=3)
    host = a.host_block
    _load(c, a)
    _evict(c, a)
    assert a.state is State.ABSENT and a.host_parked and not a.host_lent and a.host_block is host
    assert a.home.block is None and a.home.parked == bytes([3]) * a.nbytes   # unreadable, kept
    assert bytes(host) == bytes(a.nbytes) and c.backend.used == 0            # the slot is free
    assert c.backend.host_in_use == a.nbytes                                 # the host tier's still
    _load(c, a)
    assert a.host_lent and not a.host_parked and bytes(a.replica) == bytes([3]) * a.nbytes
    _evict(c, a)
    _load(c, a)
    assert _moves(c) == ["attach_lent", "park", "attach_parked", "park", "attach_parked"]
    assert c.stats.page_moves == 1 and c.stats.page_protects == 4
    assert c.stats.moved_bytes == 3 * a.nbytes and c.stats.unparked_bytes == 2 * a.nbytes
    assert c.stats.copied_bytes == 0 and c.stats.parked_bytes == c.stats.returned_bytes == 2 * a.nbytes


def test_a_parked_replica_the_host_cache_drops_is_freed_and_loads_from_disk_again():
    c = _lending_core(device=64 * KiB, host=4 * KiB, policy="lru", parks=True)
    a, b = _tensor(c, "a", fill=1), _tensor(c, "b", fill=2)
    _load(c, a)
    _evict(c, a)
    assert a.host_parked
    _load(c, b)                                        # LRU: b's replica displaces a's parked one
    assert not a.host_parked and not a.host_valid and a.home.parked is None
    assert c.backend.host_in_use <= c.backend.host_budget
    assert "unpark" in _moves(c)
    _load(c, a)                                        # from disk, into a fresh block
    assert bytes(a.replica) == bytes([1]) * a.nbytes and c.stats.loads_from["remote"] == 3


def test_a_written_parked_replica_is_written_back_first_and_the_new_bytes_are_parked():
    c = _lending_core(parks=True)
    a = _host_only(c, "a", fill=5)
    _load(c, a)
    a.replica[:] = bytes([9]) * a.nbytes               # compute writes the weight in place
    a.home.written = True
    _evict(c, a)
    assert c.backend.store["a"] == bytes([9]) * a.nbytes   # written back before the drop
    assert a.host_parked and a.home.parked == bytes([9]) * a.nbytes
    _load(c, a)
    assert bytes(a.replica) == bytes([9]) * a.nbytes


def test_a_park_the_kernel_refuses_moves_the_pages_back_instead():
    c = _lending_core(parks=True)
    a = _host_only(c, "a", fill=6)

    def park(home, block):
        raise RuntimeError("injected: ENOMEM, too many mappings")
    c.backend.park = park
    _load(c, a)
    _evict(c, a)
    assert not a.host_parked and bytes(a.host_block) == bytes([6]) * a.nbytes
    assert c.backend.used == 0 and a.home.block is None
    _load(c, a)
    assert bytes(a.replica) == bytes([6]) * a.nbytes


def test_an_unpark_the_kernel_refuses_fails_that_load_only():
    c = _lending_core(parks=True)
    a = _host_only(c, "a", fill=7)
    _load(c, a)
    _evict(c, a)
    real, calls = c.backend.attach_parked, []

    def attach_parked(home, block):
        calls.append(home)
        if len(calls) == 1:
            raise RuntimeError("injected: mprotect refused")
        real(home, block)
    c.backend.attach_parked = attach_parked
    f = c.submit(Kind.PREFETCH, [a])
    c.drain()
    assert "mprotect refused" in str(f.exception(0)) and a.state is State.ABSENT
    assert a.host_parked and a.home.parked == bytes([7]) * a.nbytes and c.backend.used == 0
    _load(c, a)
    assert bytes(a.replica) == bytes([7]) * a.nbytes


def test_a_dropped_shared_mapping_parks_and_its_next_load_unparks_it_with_no_transfer():
    c = Core(device=64 * KiB, host=0)
    a = _tensor(c, "a", fill=4)
    c.backend.mapped = []
    real_load = c.backend.start_load

    def start_load(key, dst, nbytes, tag, verify, shape=None, dtype=None):
        c.backend.mapped.append(dst)             # the shared tier maps its block over dst
        real_load(key, dst, nbytes, tag, verify)
    c.backend.start_load = start_load
    _load(c, a)
    _evict(c, a)
    assert a.mapping_parked and a.home.parked == bytes([4]) * a.nbytes and c.backend.used == 0
    loads = c.backend.calls.count("start_load")
    _load(c, a)
    assert not a.mapping_parked and bytes(a.replica) == bytes([4]) * a.nbytes
    assert c.backend.calls.count("start_load") == loads              # no transfer: unparked
    assert _moves(c) == ["park", "attach_parked"]        # (the fake's attach/detach go unrecorded)
    assert c.stats.unparked_bytes == a.nbytes and c.stats.loads_from == {"host": 1, "remote": 1}
    c.backend.mapped = []                        # not mapped any more: an ordinary detach
    _evict(c, a)
    assert not a.mapping_parked and a.home.parked is None and a.home.block is None
    assert _moves(c) == ["park", "attach_parked"]


@pytest.mark.parametrize("parks", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_bytes_and_budgets_hold_under_random_steps_with_lending(seed, parks):
    rnd = random.Random(seed)
    c = _lending_core(device=40 * KiB, host=24 * KiB, policy=rnd.choice(["lru", "belady"]), parks=parks)
    recs = [_tensor(c, f"t{i}", fill=i + 1, nbytes=rnd.choice([4, 8]) * KiB) for i in range(10)]
    truth = {r.name: bytes([i + 1]) * r.nbytes for i, r in enumerate(recs)}
    pinned = []
    for step in range(300):
        op = rnd.random()
        if op < 0.4:
            c.submit(Kind.PREFETCH, rnd.sample(recs, rnd.randint(1, 2)), priority=rnd.randint(0, 3))
        elif op < 0.5 and len(pinned) < 2:
            rec = rnd.choice(recs)
            c.submit(Kind.PIN, [rec])
            pinned.append(rec)
        elif op < 0.6 and pinned:
            c.submit(Kind.UNPIN, [pinned.pop(rnd.randrange(len(pinned)))])
        elif op < 0.75:
            c.submit(Kind.EVICT, [rnd.choice(recs)])
        elif op < 0.82:
            rec = rnd.choice(recs)
            if rec.state is State.RESIDENT and rec.home.block is not None:
                value = bytes([(step % 200) + 20]) * rec.nbytes   # compute writes it in place
                rec.replica[:] = value
                rec.home.written = True
                truth[rec.name] = value
        c.step(pick=None if rnd.random() < 0.7 else {rnd.choice(["load", "store", "verify", "stage"])})
        assert c.backend.host_in_use <= c.backend.host_budget
        for rec in recs:
            if rec.state is State.RESIDENT and rec.home.block is not None:
                assert bytes(rec.replica) == truth[rec.name], (seed, step, rec.name)
            if rec.host_lent or rec.host_parked:
                assert rec.host_block is not None and bytes(rec.host_block) == bytes(rec.nbytes)
            assert not (rec.host_lent and rec.host_parked)
            if rec.host_parked:
                assert rec.state is State.ABSENT and rec.home.parked == truth[rec.name], (seed, step)
            else:
                assert rec.home.parked is None, (seed, step, rec.name)
    c.drain()                     # every pin has landed (an unpin may have overtaken its pin)
    for rec in recs:
        for _ in range(rec.pins):
            c.submit(Kind.UNPIN, [rec])
    c.drain()
    for rec in recs:
        _evict(c, rec)
        assert not rec.host_lent
        if rec.host_valid:
            held = rec.home.parked if rec.host_parked else bytes(rec.host_block)
            assert held == truth[rec.name], rec.name
    for rec in recs:
        _load(c, rec)
        assert bytes(rec.replica) == truth[rec.name], rec.name
        _evict(c, rec)
    assert all(f.done() for f in c.futures) and not c.s.transfers
    assert c.stats.copied_bytes == 0 and c.stats.moved_bytes > 0


def test_a_block_reclaimed_before_its_fence_waits_for_that_fence_when_dropped_again():
    """A drop of a block compute read waits for a fence; a load of the same tensor before
    it takes the block back (no transfer). Dropped again, it must still wait for that
    fence: the reclaim once forgot compute had read it, so the second drop freed the pages
    at once under kernels still queued to read them (a control-plane prefetch flood over
    the budget crashed a host process with SIGSEGV)."""
    c = _lending_core()
    a = _host_only(c, "a", fill=6)
    _load(c, a)
    a.exposed = True                      # bind_for_compute: a unit's compute reads it
    block = a.block
    _drop(c, a)
    assert a.state is State.ABSENT and [e[0] for e in c.s.memory.unfenced] == [block]
    _load(c, a)                           # reclaimed: the pages never left
    assert a.block is block and c.stats.reclaims == 1 and not c.s.memory.unfenced
    _drop(c, a)                           # no fence reached since compute read it
    assert [e[0] for e in c.s.memory.unfenced] == [block], "freed before the compute fence"
    assert a.home.block is block and c.backend.used == block.capacity
    with c.lock:
        c.s.memory.fence_if(lambda: True) # the whole-queue fence: now it may go
    assert not c.s.memory.unfenced and c.backend.used == 0
    assert bytes(a.host_block) == bytes([6]) * a.nbytes


class _FenceWord:
    """A compute marker (backend.marker) whose fence word the test advances: epoch e is
    reached once compute ran past it. A reservation waiting on it just waits (the test's
    next steps advance the word), as wake_at_fence lets the real scheduler wait."""

    def __init__(self):
        self.word = self.epoch = 0

    def mark(self):
        self.epoch += 1
        return self.epoch

    def reached(self, epoch):
        return epoch <= self.word


@pytest.mark.parametrize("seed", range(8))
def test_pages_compute_read_never_leave_before_their_fence_under_random_steps(seed):
    """A unit's compute reads its blocks (bind_for_compute: exposed), and its kernels may run
    after the unpin until the fence marked behind them. Under random prefetches (evicting to
    make room), reclaims, pins, unpins and evictions, no block is freed, parked or moved back
    to the host before the fence of its last read (a reclaim once forgot the read: SIGSEGV)."""
    rnd = random.Random(seed)
    c = _lending_core(device=24 * KiB, host=48 * KiB, parks=rnd.random() < 0.5)
    fence = c.backend.marker = _FenceWord()
    c.backend.wake_at_fence = lambda epoch: True
    recs = [_tensor(c, f"t{i}", fill=i + 1, nbytes=4 * KiB) for i in range(8)]
    read = {}                     # id(block) -> the fence epoch behind compute's last read of it
    early = []

    def watch(method):
        def checked(*args):
            block = next(a for a in args if isinstance(a, bytearray) and hasattr(a, "capacity"))
            if read.get(id(block), 0) > fence.word:
                early.append((method.__name__, step))
            return method(*args)
        return checked
    for name in ("free_device", "detach_lent", "park"):
        setattr(c.backend, name, watch(getattr(c.backend, name)))
    pinned = []
    for step in range(600):
        op = rnd.random()
        if op < 0.45:
            c.submit(Kind.PREFETCH, rnd.sample(recs, rnd.randint(1, 3)), priority=rnd.randint(0, 3))
        elif op < 0.6 and len(pinned) < 2:
            rec = rnd.choice(recs)
            c.submit(Kind.PIN, [rec])
            pinned.append(rec)
        elif op < 0.8 and pinned:
            rec = pinned.pop(rnd.randrange(len(pinned)))
            if rec.pins and rec.state is State.RESIDENT:     # its unit computed (session.release)
                rec.exposed, rec.compute_epoch = True, fence.mark()
                read[id(rec.block)] = rec.compute_epoch
            c.submit(Kind.UNPIN, [rec])
        elif op < 0.85:
            c.submit(Kind.EVICT, [rnd.choice(recs)])
        elif op < 0.95:
            fence.word = rnd.randint(fence.word, fence.epoch)   # compute runs on
        c.step()
        assert not early, (seed, early)
