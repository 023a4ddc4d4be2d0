"""Compute that writes a resident tensor in place (no Python API call): the core asks
the backend's write watch before every drop it would make as clean, so such a write
is written back, never lost — also when it lands after the drop was decided, while
the block waited for its compute fence. Driven step by step over the fake backend.
"""
from prefetchd.core.records import State
from prefetchd.core.requests import Kind

from .fake_backend import Home
from .test_moves import KiB, Core


def resident_with_home(c, name="a", fill=1):
    rec = c.tensor(name, fill=fill)
    rec.home = Home()
    c.submit(Kind.PIN, [rec])
    c.drain()
    assert rec.state is State.RESIDENT and rec.home.block is rec.block
    return rec


def compute_writes(rec, value):
    rec.replica[:] = bytes([value]) * rec.nbytes
    rec.home.written = True


def test_a_replica_written_by_compute_is_written_back_before_it_is_dropped():
    c = Core()
    a = resident_with_home(c)
    compute_writes(a, 9)
    c.submit(Kind.UNPIN, [a])
    ev = c.submit(Kind.EVICT, [a])
    c.drain()
    assert ev.result(0) is None and a.state is State.ABSENT
    assert c.backend.store["a"] == bytes([9]) * a.nbytes and c.stats.writebacks == 1
    assert c.stats.compute_writes == 1


def test_a_write_that_lands_while_the_drop_waits_for_its_fence_is_kept():
    c = Core()
    a = resident_with_home(c)
    a.exposed = True                    # compute read it: the block waits for a fence
    c.submit(Kind.UNPIN, [a])
    c.backend.on_fence = lambda: compute_writes(a, 4)   # the queue it drains wrote it
    ev = c.submit(Kind.EVICT, [a])
    c.drain()
    assert ev.result(0) is None and a.state is State.ABSENT
    assert c.backend.store["a"] == bytes([4]) * a.nbytes, "the late write was lost"
    assert c.stats.compute_writes == 1 and c.backend.used == 0
    c.backend.on_fence = None
    c.submit(Kind.PIN, [a])
    c.drain()
    assert bytes(a.replica) == bytes([4]) * a.nbytes


def test_flush_writes_back_what_compute_wrote():
    c = Core()
    a = resident_with_home(c)
    compute_writes(a, 6)
    assert not a.dirty                  # nothing told the daemon: only the watch knows
    fl = c.submit(Kind.FLUSH, None)
    c.drain()
    assert fl.result(0) is None and not a.dirty and a.state is State.RESIDENT
    assert c.backend.store["a"] == bytes([6]) * a.nbytes


def test_a_replica_nobody_wrote_is_dropped_without_a_write_back():
    c = Core()
    a = resident_with_home(c)
    c.submit(Kind.UNPIN, [a])
    c.submit(Kind.EVICT, [a])
    c.drain()
    assert a.state is State.ABSENT and c.stats.writebacks == 0 and c.stats.compute_writes == 0


def test_a_page_move_that_keeps_failing_fails_the_load_waiting_for_room_saying_why():
    """An internal error while freeing memory, on every step: the load waiting for that
    room is refused naming the failure (before: retried each step, then refused as if
    pinned tensors held the device)."""
    c = Core(device=12 * KiB)                 # a (4 KiB) and b (8 KiB) do not fit together
    a = resident_with_home(c)
    a.exposed = True
    c.submit(Kind.UNPIN, [a])
    b = c.tensor("b", 8 * KiB)

    def refuse(home, block):
        raise RuntimeError("injected: mremap refused")
    c.backend.detach = refuse
    pin = c.submit(Kind.PIN, [b])
    for _ in range(20):
        c.step()
        if pin.done():
            break
    assert pin.done(), "the pin never completed"
    assert "internal error while making room" in str(pin.exception(0))
    assert b.state is State.ABSENT
