"""Parked homes (native/src/home_parking.cpp): lent pages stay under the home, unreadable.

Arena.park detaches the device slot and leaves the home's pages under it PROT_NONE;
attach_parked makes them readable again with a slot attached; unpark gives them to a
host block or frees them. "The same pages" is checked on the physical frames where
the kernel shows them (test_page_moves.frames), and always by the bytes.
"""
import numpy as np
import pytest

from prefetchd import _native

from .test_page_moves import MiB, PAGE, filled, frames


def _setup(nbytes, huge=True):
    pool = _native.HostPool(64 * MiB, PAGE, huge_pages=huge)
    arena = _native.Arena(64 * MiB, PAGE, huge_pages=huge)
    vrange = _native.VirtualRange(max(64 * MiB, 2 * nbytes))
    return pool, arena, vrange, vrange.slice(0, nbytes)


def _lent(nbytes, seed, huge=True):
    """A home lent the pages of a host block filled from `seed`:
    (pool, arena, vrange, home, host block, device slot, the bytes written, the
    host block's frames before the lend)."""
    pool, arena, vrange, home = _setup(nbytes, huge)
    host, slot = pool.alloc(nbytes), arena.alloc(nbytes)
    canary = filled(host, seed)
    before = frames(host, nbytes)
    arena.attach(slot, home, pages_from=host)
    return pool, arena, vrange, home, host, slot, canary, before


@pytest.mark.parametrize("huge", [True, False], ids=["huge-pages", "4KiB-pages"])
@pytest.mark.parametrize("nbytes", [100, 5000, 3 * MiB + 100, 8 * MiB])
def test_a_parked_home_keeps_the_same_pages_and_unparks_them_without_a_move(huge, nbytes):
    pool, arena, _vrange, home, host, slot, canary, before = _lent(nbytes, nbytes, huge)
    arena.park(home, slot)
    assert home.parked and not home.attached and not slot.attached
    assert not np.frombuffer(host, np.uint8).any(), "the pages went back to the host block"
    if None not in before:
        assert frames(home.address, nbytes) == before      # still under the home
    slot.release()                                          # the device slot is free
    assert arena.used == 0 and pool.used == nbytes          # the pages are the host tier's
    again = arena.alloc(nbytes)
    arena.attach_parked(again, home)
    assert home.attached and home.block is again and not home.parked
    assert np.array_equal(np.frombuffer(home, np.uint8), canary)
    if None not in before:
        assert frames(home.address, nbytes) == before
    assert not home.take_written()                          # watched again, clean
    arena.park(home, again)
    arena.unpark(home, pages_to=host)                       # the host tier takes them back
    assert not home.parked and np.array_equal(np.frombuffer(host, np.uint8), canary)
    if None not in before:
        assert frames(host, nbytes) == before
    arena.attach(again, home, pages_from=host)              # and lends them again
    assert np.array_equal(np.frombuffer(home, np.uint8), canary)
    arena.detach(home, again, pages_to=host)


def test_a_write_after_unparking_is_seen_and_kept():
    _pool, arena, _vrange, home, host, slot, _, _ = _lent(3 * PAGE, 4)
    arena.park(home, slot)
    arena.attach_parked(slot, home)
    np.frombuffer(home, np.uint8)[:] = 7                    # a write faults once and is let through
    assert home.take_written()
    arena.park(home, slot)
    arena.attach_parked(slot, home)
    assert (np.frombuffer(home, np.uint8) == 7).all() and not home.take_written()
    arena.park(home, slot)
    arena.unpark(home, pages_to=host)
    assert (np.frombuffer(host, np.uint8) == 7).all()
    np.frombuffer(host, np.uint8)[:] = 8                    # the host block is writable again


def test_unparking_without_a_host_block_frees_the_pages():
    _pool, arena, _vrange, home, _host, slot, _, _ = _lent(4 * MiB, 5)
    arena.park(home, slot)
    shown = None not in frames(home.address, 4 * MiB)      # the kernel shows frames (root)
    arena.unpark(home)
    assert not home.parked and not home.attached
    if shown:
        assert frames(home.address, 4 * MiB) == [None, None, None]   # nothing behind the home now
    fresh = arena.alloc(4 * MiB)
    arena.attach(fresh, home)                               # an ordinary attach works again
    assert not np.frombuffer(home, np.uint8).any()
    arena.detach(home, fresh)


def test_parking_moves_that_cannot_be_done_are_refused_and_change_nothing():
    pool, arena, _vrange, home = _setup(8192)
    host, slot = pool.alloc(8192), arena.alloc(8192)
    canary = filled(host, 6)
    with pytest.raises(ValueError, match="has no block attached"):
        arena.park(home, slot)
    with pytest.raises(ValueError, match="holds no parked pages"):
        arena.attach_parked(slot, home)
    with pytest.raises(ValueError, match="holds no parked pages"):
        arena.unpark(home)
    arena.attach(slot, home, pages_from=host)
    other = arena.alloc(8192)
    with pytest.raises(ValueError, match="attached to another block"):
        arena.park(home, other)
    arena.park(home, slot)
    with pytest.raises(ValueError, match="holds parked pages"):
        arena.attach(other, home)                           # would drop the parked pages
    with pytest.raises(ValueError, match="cannot back a home"):
        arena.attach_parked(arena.alloc(4096), home)
    with pytest.raises(ValueError, match="cannot take the"):
        arena.unpark(home, pages_to=pool.alloc(4096))
    released = arena.alloc(8192)
    released.release()
    with pytest.raises(_native.Closed):
        arena.attach_parked(released, home)
    assert home.parked and not home.attached                # every refusal left it parked
    arena.attach_parked(slot, home)
    assert np.array_equal(np.frombuffer(home, np.uint8), canary)
    arena.detach(home, slot, pages_to=host)
    assert np.array_equal(np.frombuffer(host, np.uint8), canary)


def test_a_parked_home_that_dies_frees_its_pages():
    _pool, arena, vrange, home, _host, slot, _, _ = _lent(2 * MiB, 7)
    arena.park(home, slot)
    address = home.address
    del home                                                # its offset is free again ...
    again = vrange.slice(0, 2 * MiB)
    assert again.address == address and not again.parked
    arena.attach(slot, again)                               # ... and takes an ordinary attach
    assert not np.frombuffer(again, np.uint8).any()
    arena.detach(again, slot)
