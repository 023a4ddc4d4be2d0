"""One block of the shared host tier: a memfd segment filled once from the store.

A block is created empty, filled by one checksummed read of the owner's
FileStore (O_DIRECT where the store uses it: the destination is page-aligned and
page-padded), then its only writable mapping is dropped and the segment is
sealed (F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL): from then on
no process — the owner included — can change or resize its bytes, so every
process that maps it sees the verified data. The owner keeps one read-only
mapping (so the pages are charged to the owner's proportional set size, PSS, as
well as the workers' while they map it) and the descriptor it passes to them.
"""
import fcntl
import mmap
import os
import re

from .. import _native

PAGE = mmap.PAGESIZE
HUGE_PAGE = _native.HUGE_PAGE
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK


def segment_size(nbytes):
    """Bytes of the segment of an nbytes tensor: page-rounded (what an O_DIRECT read writes), >= 1 page."""
    return max(PAGE, -(-nbytes // PAGE) * PAGE)


class SharedBlock:
    """(key, version) -> a sealed memfd. Owner side; not thread-safe: filled on one
    fill thread, then only read."""

    def __init__(self, key, version, nbytes, crc):
        self.key, self.version, self.nbytes, self.crc = key, version, nbytes, crc
        self.size = segment_size(nbytes)
        self.fd = os.memfd_create(f"prefetchd-host:{key[:200]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.view = None            # read-only mapping once sealed
        try:
            os.ftruncate(self.fd, self.size)
        except OSError:
            os.close(self.fd)
            raise

    def fill(self, store):
        """Read the tensor from `store` (verified: every extent's CRC32C) and seal.
        Raises what the store raises (ChecksumMismatch, IOFailure, NotFound) or
        ValueError when the store's copy is not the one this block was made for."""
        info = store.info(self.key)
        if (info["version"], info["nbytes"], info["crc"]) != (self.version, self.nbytes, self.crc):
            raise ValueError(f"{self.key!r}: the owner's store now holds version {info['version']} "
                             f"({info['nbytes']} bytes, crc {info['crc']:#x}), not the one asked for")
        writable = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            advise_huge_pages(writable, self.size)
            if self.nbytes:
                store.read_sync(self.key, writable, True)
        finally:
            writable.close()        # F_SEAL_WRITE refuses while a writable mapping exists
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SEALS)
        # Populated: the pages are in the owner's page tables, so its PSS accounts for them.
        self.view = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)

    def close(self):
        """Drop the owner's mapping and descriptor; the pages go when the last process unmaps them."""
        if self.view is not None:
            self.view.close()
            self.view = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def advise_huge_pages(mapping, size):
    """Ask for huge pages for a segment's pages as they are first written. shmem honours it
    only where /sys/kernel/mm/transparent_hugepage/shmem_enabled is `advise` (or `always`,
    `within_size`); a worker then maps a 2 MiB piece with one page-table entry instead
    of 512 (docs/shared-host.md, "Huge pages")."""
    if size >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass                    # no THP in this kernel: small pages, still correct


SHMEM_HUGE = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def shmem_huge_mode(path=SHMEM_HUGE):
    """The machine's shmem huge-page mode (`never`, `advise`, `always`, `within_size`,
    `deny`, `force`), or None where the kernel has no THP. The admin sets it; prefetchd only
    reports it (docs/shared-host.md, "Huge pages")."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    chosen = re.search(r"\[(\w+)\]", text)
    return chosen.group(1) if chosen else None


def check_received(fd, nbytes, size):
    """The inode of a block a worker was sent, after checking that it is what the owner
    says: sealed against writes and resizing, and at least `size` bytes. ValueError
    if not (the caller then reads its own store); fd stays open either way."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        if seals & REQUIRED_SEALS != REQUIRED_SEALS:
            raise ValueError(f"shared block is not sealed against writes (seals {seals:#x})")
        st = os.fstat(fd)
        if size != segment_size(nbytes) or st.st_size < size:
            raise ValueError(f"shared block is {st.st_size} bytes, {nbytes} asked (segment {size})")
        return st.st_ino
    except OSError as e:
        raise ValueError(f"shared block descriptor refused: {e}") from None
