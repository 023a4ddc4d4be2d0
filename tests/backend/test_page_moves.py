"""_native.move_pages: a block's bytes change blocks without a copy (native/src/block_moves.cpp).

"The same pages" is checked on the physical page itself where the kernel shows it
(/proc/self/pagemap gives frame numbers to a privileged process), and always by
the source reading zeros after the move: a copy would leave the bytes behind.
"""
import struct

import numpy as np
import pytest

from prefetchd import _native

PAGE = 4096
HUGE = 2 << 20
MiB = 1 << 20


def frame(address):
    """The physical frame number behind a virtual address, or None where the kernel hides it."""
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // PAGE * 8)
        entry = struct.unpack("Q", f.read(8))[0]
    number = entry & ((1 << 55) - 1)
    return number if entry >> 63 and number else None


def frames(block_or_address, nbytes):
    """Frames of the first, a middle and the last page of a range (what a copy would change)."""
    base = block_or_address if isinstance(block_or_address, int) else block_or_address.address
    last = (nbytes - 1) // PAGE * PAGE
    return [frame(base + off) for off in (0, last // 2 // PAGE * PAGE, last)]


def filled(block, seed):
    view = np.frombuffer(block, np.uint8)
    view[:] = np.random.default_rng(seed).integers(0, 256, view.size, dtype=np.uint8)
    return view.copy()


@pytest.mark.parametrize("huge", [True, False], ids=["huge-pages", "4KiB-pages"])
@pytest.mark.parametrize("nbytes", [100, 5000, 3 * MiB + 100, 8 * MiB])
def test_pages_move_to_the_destination_and_back_without_a_copy(huge, nbytes):
    pool = _native.HostPool(64 * MiB, PAGE, huge_pages=huge)
    arena = _native.Arena(64 * MiB, PAGE, huge_pages=huge)
    host, device = pool.alloc(nbytes), arena.alloc(nbytes)
    canary = filled(host, nbytes)
    before = frames(host, nbytes)
    assert _native.move_pages(device, host) == -(-nbytes // PAGE) * PAGE
    assert np.array_equal(np.frombuffer(device, np.uint8), canary)
    assert not np.frombuffer(host, np.uint8).any(), "the source kept its bytes: that was a copy"
    if None not in before:
        assert frames(device, nbytes) == before
    _native.move_pages(host, device)                     # back: the same pages again
    assert np.array_equal(np.frombuffer(host, np.uint8), canary)
    assert not np.frombuffer(device, np.uint8).any()
    if None not in before:
        assert frames(host, nbytes) == before
    assert pool.used == nbytes                           # budgets unchanged by a move


def test_host_blocks_of_2MiB_or_more_start_on_a_huge_page_boundary_and_small_ones_on_their_own_pages():
    pool = _native.HostPool(64 * MiB, PAGE, huge_pages=True)
    big = [pool.alloc(n) for n in (2 * MiB, 3 * MiB + 1, 16 * MiB)]
    assert all(b.address % HUGE == 0 for b in big)
    small = [pool.alloc(n) for n in (1, 100, 4096, 5000)]
    spans = sorted((b.address, b.address + b.capacity) for b in small + big)
    assert all(a % PAGE == 0 and e % PAGE == 0 for a, e in spans)
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1)), "two blocks share a page"


def test_moving_a_small_tensor_leaves_the_tensor_in_the_next_page_intact():
    arena = _native.Arena(1 * MiB, PAGE)
    pool = _native.HostPool(1 * MiB, PAGE)
    first, second = arena.alloc(100), arena.alloc(100)   # neighbours in the arena
    assert second.address == first.address + PAGE
    theirs = filled(second, 1)
    host = pool.alloc(100)
    mine = filled(host, 2)
    _native.move_pages(first, host)
    assert np.array_equal(np.frombuffer(first, np.uint8), mine)
    assert np.array_equal(np.frombuffer(second, np.uint8), theirs)
    _native.move_pages(host, first)
    assert np.array_equal(np.frombuffer(second, np.uint8), theirs)


def test_a_move_that_cannot_be_done_is_refused_and_moves_nothing():
    pool = _native.HostPool(16 * MiB, PAGE)
    arena = _native.Arena(16 * MiB, PAGE)
    host = pool.alloc(8192)
    canary = filled(host, 3)
    small = arena.alloc(4096)
    with pytest.raises(ValueError, match="cannot take the pages"):
        _native.move_pages(small, host)
    with pytest.raises(ValueError, match="same block"):
        _native.move_pages(host, host)
    released = arena.alloc(8192)
    released.release()
    with pytest.raises(_native.Closed):
        _native.move_pages(released, host)
    attached = arena.alloc(8192)
    vrange = _native.VirtualRange(4 * MiB)
    home = vrange.slice(0, 8192)
    arena.attach(attached, home)
    with pytest.raises(ValueError, match="attached to a home"):
        _native.move_pages(attached, host)
    arena.detach(home, attached)
    assert np.array_equal(np.frombuffer(host, np.uint8), canary)
    assert host.movable and attached.movable


# ---------------------------------------------------------------- lent pages: host block <-> home

def _home(nbytes):
    vrange = _native.VirtualRange(max(64 * MiB, 2 * nbytes))
    return vrange, vrange.slice(0, nbytes)


@pytest.mark.parametrize("huge", [True, False], ids=["huge-pages", "4KiB-pages"])
@pytest.mark.parametrize("nbytes", [100, 5000, 3 * MiB + 100, 8 * MiB])
def test_a_lent_attach_moves_the_host_pages_straight_under_the_home_and_the_detach_straight_back(huge, nbytes):
    pool = _native.HostPool(64 * MiB, PAGE, huge_pages=huge)
    arena = _native.Arena(64 * MiB, PAGE, huge_pages=huge)
    host, device = pool.alloc(nbytes), arena.alloc(nbytes)
    theirs = filled(device, 9)                # the device block's own range: not touched by the lend
    canary = filled(host, nbytes)
    before = frames(host, nbytes)
    _vrange, home = _home(nbytes)
    arena.attach(device, home, pages_from=host)
    assert home.attached and home.block is device and device.attached
    assert np.array_equal(np.frombuffer(home, np.uint8), canary)
    assert not np.frombuffer(host, np.uint8).any(), "the host block kept its bytes: that was a copy"
    if None not in before:
        assert frames(home.address, nbytes) == before
    with pytest.raises(RuntimeError, match="attached to a home"):
        device.release()                      # the device block is the home's now
    arena.detach(home, device, pages_to=host)
    assert not home.attached and not device.attached
    assert np.array_equal(np.frombuffer(host, np.uint8), canary)
    if None not in before:
        assert frames(host, nbytes) == before     # the same physical pages came back
    assert np.array_equal(np.frombuffer(device, np.uint8), theirs)
    assert pool.used == nbytes
    device.release()


def test_a_lent_home_written_in_place_gives_the_written_pages_back_to_the_host_block():
    pool = _native.HostPool(16 * MiB, PAGE)
    arena = _native.Arena(16 * MiB, PAGE)
    nbytes = 3 * PAGE
    host, device = pool.alloc(nbytes), arena.alloc(nbytes)
    filled(host, 4)
    _vrange, home = _home(nbytes)
    arena.attach(device, home, pages_from=host)
    np.frombuffer(home, np.uint8)[:] = 7        # a write faults once and is let through
    assert home.take_written()
    arena.detach(home, device, pages_to=host)
    assert (np.frombuffer(host, np.uint8) == 7).all()
    np.frombuffer(host, np.uint8)[:] = 8        # and the host block is writable again
    arena.attach(device, home, pages_from=host)
    assert (np.frombuffer(home, np.uint8) == 8).all() and not home.take_written()
    arena.detach(home, device, pages_to=host)


def test_a_lend_that_cannot_be_done_is_refused_and_moves_nothing():
    pool = _native.HostPool(16 * MiB, PAGE)
    arena = _native.Arena(16 * MiB, PAGE)
    host = pool.alloc(8192)
    canary = filled(host, 5)
    device = arena.alloc(8192)
    _vrange, home = _home(8192)
    with pytest.raises(ValueError, match="cannot fill a home"):
        arena.attach(device, home, pages_from=pool.alloc(4096))
    with pytest.raises(ValueError, match="the lender is the block itself"):
        arena.attach(device, home, pages_from=device)
    released = pool.alloc(8192)
    released.release()
    with pytest.raises(_native.Closed, match="lending block is released"):
        arena.attach(device, home, pages_from=released)
    other_vrange, other = _home(8192)
    lent_elsewhere = arena.alloc(8192)
    arena.attach(lent_elsewhere, other)
    with pytest.raises(ValueError, match="lending block is attached"):
        arena.attach(device, home, pages_from=lent_elsewhere)
    assert not home.attached and not device.attached
    assert np.array_equal(np.frombuffer(host, np.uint8), canary)
    arena.attach(device, home, pages_from=host)
    with pytest.raises(ValueError, match="cannot take the"):
        arena.detach(home, device, pages_to=pool.alloc(4096))
    with pytest.raises(ValueError, match="is attached to a home"):
        arena.detach(home, device, pages_to=lent_elsewhere)
    assert home.attached                          # refused: the pages stay at the home
    arena.detach(home, device, pages_to=host)
    assert np.array_equal(np.frombuffer(host, np.uint8), canary)
    arena.detach(other, lent_elsewhere)
