"""Block.map_segment: a block backed by a sealed memfd other processes share, moved to a
home and back without a copy; writes get private pages; a release gives anonymous memory
back (native/src/segment_maps.cpp)."""
import fcntl
import os

import numpy as np
import pytest

n = pytest.importorskip("prefetchd._native")

PAGE = os.sysconf("SC_PAGE_SIZE")
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL

pytestmark = pytest.mark.skipif(not n.segment_maps_supported(),
                                reason="the kernel cannot move private file mappings (Linux < 5.13)")


def sealed_segment(nbytes, seed, name="prefetchd-host:test"):
    """(fd, bytes) of a sealed memfd holding nbytes of a pattern (page-rounded size)."""
    data = np.random.default_rng(seed).integers(0, 256, nbytes, np.uint8).tobytes()
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, -(-nbytes // PAGE) * PAGE)
    os.pwrite(fd, data, 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    return fd, data


def mapping_of(address):
    """The /proc/self/maps line of the kernel mapping holding address."""
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return line.strip()
    return None


def test_a_mapped_block_reads_the_segment_travels_to_a_home_and_back_and_releases_anonymous():
    nbytes = 3 * PAGE + 100
    fd, data = sealed_segment(nbytes, 1)
    arena = n.Arena(1 << 20)
    block = arena.alloc(nbytes)
    block.map_segment(fd, nbytes)
    os.close(fd)                               # the mapping keeps the segment
    assert block.maps_segment and memoryview(block).readonly
    assert bytes(memoryview(block)) == data
    assert "memfd:prefetchd-host:test" in mapping_of(block.address)
    home = n.VirtualRange(1 << 20).slice(0, nbytes)
    before = n.protection_changes()
    arena.attach(block, home)                  # arrives read-only: watched, no protection change
    assert bytes(memoryview(home)) == data
    assert "memfd:prefetchd-host:test" in mapping_of(home.address)   # the same pages, not a copy
    arena.detach(home, block)
    assert n.protection_changes() == before
    assert bytes(memoryview(block)) == data and block.maps_segment
    address = block.address
    block.release()
    assert "memfd" not in mapping_of(address)  # anonymous again: the segment is not held
    again = arena.alloc(nbytes)
    assert again.address == address and not again.maps_segment and not memoryview(again).readonly
    memoryview(again)[:3] = b"xyz"
    assert bytes(memoryview(again))[:3] == b"xyz"


def test_a_write_at_the_home_gets_a_private_page_and_the_segment_never_changes():
    nbytes = 2 * PAGE
    fd, data = sealed_segment(nbytes, 2)
    arena = n.Arena(1 << 20)
    block = arena.alloc(nbytes)
    block.map_segment(fd, nbytes)
    home = n.VirtualRange(1 << 20).slice(0, nbytes)
    arena.attach(block, home)
    np.frombuffer(home, np.uint8)[PAGE] = data[PAGE] ^ 0xFF    # compute writes: faults, then copy-on-write
    assert home.take_written()
    arena.detach(home, block)
    got = bytes(memoryview(block))
    assert got[:PAGE] == data[:PAGE] and got[PAGE] == data[PAGE] ^ 0xFF
    assert os.pread(fd, nbytes, 0) == data     # the other processes' pages are untouched
    np.frombuffer(block, np.uint8)[0] = 5      # a writer of the block gets private pages too
    assert os.pread(fd, 1, 0) == data[:1]
    block.release()
    os.close(fd)


def test_pages_moved_out_of_a_mapped_block_carry_the_mark():
    nbytes = 2 * PAGE
    fd, data = sealed_segment(nbytes, 3)
    pool = n.HostPool(1 << 20)
    arena = n.Arena(1 << 20)
    staged = pool.alloc(nbytes)
    staged.map_segment(fd, nbytes)
    os.close(fd)
    device = arena.alloc(nbytes)
    n.move_pages(device, staged)
    assert device.maps_segment and bytes(memoryview(device)) == data
    assert staged.maps_segment                 # its range still maps the file (no pages): put back at release
    staged.release()
    device_address = device.address
    device.release()
    assert "memfd" not in (mapping_of(device_address) or "")


def test_map_segment_refuses_what_it_cannot_map():
    fd, _ = sealed_segment(PAGE, 4)
    arena = n.Arena(1 << 20)
    block = arena.alloc(4 * PAGE)
    with pytest.raises(ValueError, match="the segment holds 4096 bytes, 16384 asked"):
        block.map_segment(fd, 4 * PAGE)
    with pytest.raises(ValueError, match="do not fit the block's capacity"):
        arena.alloc(PAGE).map_segment(fd, 2 * PAGE)
    with pytest.raises(ValueError, match="fstat"):
        block.map_segment(987654, PAGE)
    home = n.VirtualRange(1 << 20).slice(0, 4 * PAGE)
    arena.attach(block, home)
    with pytest.raises(ValueError, match="already attached"):
        block.map_segment(fd, PAGE)
    arena.detach(home, block)
    block.release()
    with pytest.raises(Exception, match="released"):
        block.map_segment(fd, PAGE)
    os.close(fd)
