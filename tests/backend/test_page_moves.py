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
