"""Shared blocks of 2 MiB or more ask shmem for huge pages (blocks.advise_huge_pages);
where the admin allows it (shmem_enabled `advise`) they get them, and fill, map, write
and release behave exactly as with small pages. The mode is the machine's: the second
test sets it for its own duration (root only) and puts the old one back."""
import os

import numpy as np
import pytest

from prefetchd import _native
from prefetchd.sharedhost.blocks import SHMEM_HUGE, SharedBlock, shmem_huge_mode
from procs import stage

BIG, SMALL = 1 << 20, 1 << 18          # floats: a 4 MiB tensor (huge-page eligible), a 1 MiB one


def test_shmem_huge_mode_reads_the_bracketed_choice(tmp_path):
    sysfs = tmp_path / "shmem_enabled"
    sysfs.write_text("always within_size [advise] never deny force\n")
    assert shmem_huge_mode(str(sysfs)) == "advise"
    sysfs.write_text("garbage\n")
    assert shmem_huge_mode(str(sysfs)) is None
    assert shmem_huge_mode(str(tmp_path / "absent")) is None


@pytest.fixture(params=["never", "advise"])
def shmem_mode(request):
    if os.geteuid() != 0 or not os.access(SHMEM_HUGE, os.W_OK) or shmem_huge_mode() is None:
        pytest.skip("needs root and a kernel with shmem transparent huge pages")
    before = shmem_huge_mode()
    with open(SHMEM_HUGE, "w") as f:
        f.write(request.param)
    try:
        yield request.param
    finally:
        with open(SHMEM_HUGE, "w") as f:
            f.write(before)


def huge_kib(key):
    """kB of the owner's view of block `key` mapped with huge-page entries (smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split()[0] and not line.split()[0].endswith(":"):
            inside = f"memfd:prefetchd-host:{key} " in line + " "
        elif inside and line.startswith("ShmemPmdMapped:"):
            total += int(line.split()[1])
    return total


def test_big_blocks_get_huge_pages_where_shmem_allows_and_behave_the_same(shmem_mode, tmp_path):
    tensors = {"big": (1, BIG), "small": (2, SMALL)}
    store = _native.FileStore(stage(str(tmp_path), tensors))
    blocks = {}
    try:
        for name in tensors:
            info = store.info(name)
            blocks[name] = SharedBlock(name, info["version"], info["nbytes"], info["crc"])
            blocks[name].fill(store)
        assert huge_kib("small") == 0                       # under 2 MiB: never advised
        assert huge_kib("big") == (4096 if shmem_mode == "advise" else 0)

        big = blocks["big"]
        want = np.random.default_rng(1).standard_normal(BIG).astype(np.float32)
        assert np.array_equal(np.frombuffer(big.view, np.float32), want)
        arena = _native.Arena(16 << 20)
        block = arena.alloc(big.nbytes)
        block.map_segment(big.fd, big.nbytes)
        home = _native.VirtualRange(8 << 20).slice(0, big.nbytes)
        arena.attach(block, home)
        got = np.frombuffer(home, np.float32)
        assert np.array_equal(got, want)
        got[BIG // 2] = 7.0                                 # compute writes: a private page
        assert home.take_written()
        arena.detach(home, block)
        assert np.frombuffer(block, np.float32)[BIG // 2] == 7.0
        assert np.array_equal(np.frombuffer(big.view, np.float32), want)   # the segment never changes
        block.release()
    finally:
        for b in blocks.values():
            b.close()
        store.close()
