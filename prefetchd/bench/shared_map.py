"""Copy or map? What a load from the shared host tier costs on the cpu backend.

A shared block is a sealed memfd of 4 KiB pages (shmem here has no transparent
huge pages unless /sys/kernel/mm/transparent_hugepage/shmem_enabled allows them,
and hugetlb memfds need reserved pages). Interleaved, per round, for one block:

    private  bulk_copy from a private host block into a device block (a private
             host-cache hit: the baseline)
    copy     mmap the shared segment, bulk_copy it into a device block, munmap
    copy_populated  the same with MAP_POPULATE
    pread    no mapping: preadv from the memfd into the device block (the kernel
             copies from the shmem pages; what prefetchd.sharedhost.client does)
    map      mmap the shared segment and fault every page in by reading it
             (what a tensor home mapping the shared pages would cost before
             compute has read all of it once), munmap
    populate mmap with MAP_POPULATE (the kernel maps every page in one call), munmap

    python -m prefetchd.bench.shared_map [--mib 64] [--rounds 7]
"""
import argparse
import json
import mmap
import os
import statistics
import sys
import time

import numpy as np

from .. import _native


def _timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(mib=64, rounds=7):
    nbytes = mib << 20
    fd = os.memfd_create("bench-shared", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    os.pwrite(fd, np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8).tobytes(), 0)
    private = _native.aligned_buffer(nbytes)
    _native.bulk_copy(private, memoryview(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)))
    device = _native.aligned_buffer(nbytes)
    memoryview(device)[:] = b"\0" * nbytes            # faulted once, like the arena's reused pages
    page = mmap.PAGESIZE

    def copy():
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        _native.bulk_copy(device, m, nbytes)
        m.close()

    def copy_populated():
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)
        _native.bulk_copy(device, m, nbytes)
        m.close()

    def pread():
        with memoryview(device) as dst:
            got = os.preadv(fd, [dst], 0)
        assert got == nbytes

    def fault_in():
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        view = np.frombuffer(m, np.uint8)
        int(view[::page].sum())                       # one read per page: every page faulted
        del view
        m.close()

    def populate():
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)
        m.close()

    cases = {"private": lambda: _native.bulk_copy(device, private, nbytes), "copy": copy,
             "copy_populated": copy_populated, "pread": pread, "map": fault_in, "populate": populate}
    times = {k: [] for k in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            times[name].append(_timed(fn))
    os.close(fd)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"mib": mib, "rounds": rounds, "page_size": page,
            "median_seconds": med, "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items()},
            "ratio_to_private": {k: v / med["private"] for k, v in med.items()},
            "cheapest_load": min(("copy", "copy_populated", "pread", "map", "populate"), key=med.get)}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m prefetchd.bench.shared_map", description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    json.dump(run(a.mib, a.rounds), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
