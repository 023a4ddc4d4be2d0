"""The CPU backend: the native arena is the device tier.

Device memory on this backend is host memory reserved up front (capacity = the
device budget, faulted in on first use), so a "device" block is a 4 KiB-aligned
arena slice. A managed tensor lives at a stable *home* (a slice of a native
VirtualRange) that MindSpore views without a copy (`Tensor.from_numpy`);
`attach` moves a loaded block's pages there and `detach` moves them back, so
the framework tensor is bound once and never rebound (docs/stable-addresses.md).
The remote tier is the native FileStore; copies and I/O run on native copy
streams whose completions land in one native CompletionQueue.
"""
import logging
import os
import shutil
import threading

import numpy as np

from .. import _native
from .. import limits
from .base import ALIGN as _ALIGN, HostAndStoreTiers, TransferKind, open_store

RANGE_ALIGN = _native.HUGE_PAGE    # virtual ranges start on a huge-page boundary
ARENA_SPACE = 2          # arena address space per byte of device budget

log = logging.getLogger("prefetchd")


def set_nice(streams, nice):
    """Give the copy-stream threads `nice` (config `io_nice`). A disk read's stream thread
    works in short bursts (submit, reap, checksum) between waits; at the process's nice it
    queues behind MindSpore's compute threads, which spin rather than sleep, and the disk
    idles meanwhile: reads beside a batch-8 forward ran 1.08-1.28x slower than alone, and
    1.03x with the thread at nice -10 (docs/performance.md, "Spread host cache"). Below the
    process's nice needs CAP_SYS_NICE or RLIMIT_NICE; without them the threads keep theirs."""
    for stream in streams:
        try:
            os.setpriority(os.PRIO_PROCESS, stream.native_id, nice)
        except OSError as e:
            log.info("prefetchd: io_nice %d not applied to the %s stream's thread (%s); it keeps nice %d",
                     nice, stream.name, e.strerror, os.getpriority(os.PRIO_PROCESS, 0))


class CpuBackend(HostAndStoreTiers):
    name = "cpu"
    granularity = _ALIGN     # home offsets are multiples of it (the page size)

    def __init__(self, config):
        # The arena and pool are faulted lazily: refuse a budget the machine
        # could never back now, not with an OOM kill once it fills.
        limits.check_budgets(config.device_budget, config.host_budget)
        self._own_dir = config.store_dir is None
        # Twice the budget in address space: with stable addresses a block's place in
        # the arena means nothing to the framework, so the spare range only keeps
        # fragmentation from refusing a load that fits the budget. The watermark
        # still bounds the bytes reserved, and released ranges are MADV_FREE.
        # Huge pages (blocks of 2 MiB or more on 2 MiB boundaries, advised
        # MADV_HUGEPAGE): a host->device memcpy runs ~18% faster with fewer TLB
        # misses, and attach/detach and the MADV_FREE of a release handle one
        # entry per 2 MiB instead of 512 (docs/stable-addresses.md).
        self.device = _native.Arena(ARENA_SPACE * config.device_budget, _ALIGN, huge_pages=config.huge_pages)
        probe = self.device.alloc(0)
        self._base = probe.address   # arena offset = address - base
        probe.release()
        # Host blocks of 2 MiB or more start on a 2 MiB boundary and are advised
        # MADV_HUGEPAGE (whole huge pages only): their pages move under a device block
        # and a home (both 2 MiB-aligned from that size up) instead of being copied, and
        # a 2 MiB-aligned move is one page-middle-directory entry per 2 MiB. Where THP is
        # off the advice is a no-op and the moves take 4 KiB entries (docs/stable-addresses.md).
        self.host = _native.HostPool(config.host_budget, _ALIGN, huge_pages=config.huge_pages)
        self.store = open_store(config)
        self.io_engine = self.store.engine
        self.cq = _native.CompletionQueue()
        # Loads and stores get their own streams so a write-back never queues
        # behind the prefetch that needs the space it frees.
        self.load_stream = _native.Stream("load")
        self.store_stream = _native.Stream("store") if config.copy_streams > 1 else self.load_stream
        set_nice({self.load_stream, self.store_stream}, config.io_nice)
        self._scratch = {}  # tag -> buffer kept alive while a verify read runs
        self._marker = None  # ComputeMarker once the layer hooks ask for one
        self._marker_lock = threading.Lock()   # sessions on several threads get one marker
        # A host->device copy is a memcpy on the cores compute runs on; MindSpore's
        # kernels use all of them and wait for the slowest (plan.Inputs). Loads from the
        # host tier move pages instead (attach_lent); what still copies is a load of
        # register()'s values and a host block that cannot be moved.
        self.copy_contention = 1.0
        # Loads from the remote tier through a host tier other daemons share (opt-in).
        self.shared = None
        if config.shared_host:
            from ..sharedhost.loads import attach
            try:
                self.shared = attach(config.shared_host, self, config.name,
                                     self._maps_shared if config.shared_host_map else None)
            except OSError as e:
                self.close()
                from ..errors import StorageError
                raise StorageError(f"shared_host {config.shared_host}: cannot attach to the shared "
                                   f"host tier: {e}") from None

    # memory -----------------------------------------------------------------
    def alloc_device(self, nbytes, prefer=None):
        """A device block; at the address `prefer` (a previous block's) when that range is free."""
        offset = prefer - self._base if prefer is not None and self._base is not None else -1
        return self.device.alloc(nbytes, offset if 0 <= offset < self.device.capacity else -1)

    def free_device(self, block):
        block.release()
        if self.shared is not None:
            self.shared.unmapped(block)   # its range mapped a shared segment: the lease ends now

    def _maps_shared(self, block):
        """Whether a shared-tier load into `block` maps the segment (no copy): device blocks
        (their pages move to the home and back, carrying the mapping) where the kernel can
        move file mappings; a host block or an older kernel gets a copy."""
        return (_native.segment_maps_supported()
                and self._base <= block.address < self._base + self.device.capacity)

    def device_used(self):
        return self.device.used

    def device_capacity(self):
        return self.device.capacity // ARENA_SPACE

    # stable addresses -----------------------------------------------------------
    @staticmethod
    def reserve(nbytes):
        """Address space for a unit's (or one tensor's) homes; no memory behind it."""
        return _native.VirtualRange(nbytes, RANGE_ALIGN)

    @staticmethod
    def home(vrange, offset, nbytes):
        """The home of one tensor: `nbytes` at page-aligned `offset` of `vrange`."""
        return vrange.slice(offset, nbytes)

    def attach(self, home, block):
        """Make `block`'s bytes the tensor's: its pages move to `home` (no copy)."""
        self.device.attach(block, home)

    def detach(self, home, block):
        """Move the pages back to `block`; reading `home` faults until the next attach."""
        self.device.detach(home, block)

    # Device and host tier are the same RAM here: a load from the host tier moves the
    # host block's pages straight under the home, one mremap (the device block is
    # attached holding none of them: it is the device budget's slot), and they stay
    # there, parked, after the drop. No byte copied.
    @staticmethod
    def lends(host_block):
        """Whether attach_lent can take host_block's pages: private anonymous memory
        (Block.movable). Others (a segment shared with other processes) are copied."""
        return getattr(host_block, "movable", False)

    def attach_lent(self, home, block, host_block):
        """host_block's pages move under `home` (no copy); host_block holds none until
        detach_lent, and `block` is attached holding none."""
        self.device.attach(block, home, pages_from=host_block)

    def detach_lent(self, home, block, host_block):
        """The home's pages (host_block's, written or not) move back under host_block."""
        self.device.detach(home, block, pages_to=host_block)

    # Parking (docs/stable-addresses.md, "Parked pages"): the drop leaves the lent pages
    # under the home, PROT_NONE, instead of moving them back; the next load unprotects
    # them. One TLB flush per tensor per pass instead of one per 2 MiB moved.
    # A shared-tier mapping parks too, where the owner's budget holds the whole store
    # (sharedhost/loads.py, "Parked mappings"): its lease follows the pages.
    parks = True

    def parks_mapping(self, block):
        """Whether the drop of `block` (attached, mapping a leased shared segment) may park
        the mapping under the home instead of detaching it."""
        return self.shared is not None and self.shared.parks(block)

    def park(self, home, block):
        """Detach `block` (the device slot); the home keeps the pages, unreadable."""
        self.device.park(home, block)
        if self.shared is not None:
            self.shared.parked(block, home)

    def attach_parked(self, home, block):
        """The parked pages readable again under `home`, `block` attached as their slot."""
        self.device.attach_parked(block, home)
        if self.shared is not None:
            self.shared.unparked(home, block)

    def unpark(self, home, host_block=None):
        """The parked pages back under host_block, or freed without one."""
        self.device.unpark(home, pages_to=host_block)
        if self.shared is not None:
            self.shared.dropped(home)

    @staticmethod
    def written(home):
        """Whether compute wrote `home` since it was attached or since the last True. An
        attached home is read-only: the first write faults, and the native handler makes
        it writable and counts the write (native/include/home_faults.h)."""
        return home.take_written()

    # framework binding --------------------------------------------------------
    @staticmethod
    def view(buffer, shape, dtype):
        """A numpy view (no copy) of a Block, a Home or any buffer."""
        count = int(np.prod(shape)) if len(shape) else 1
        return np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape)

    def bind(self, target, buffer, shape, dtype):
        """Point the framework tensor `target` at `buffer` (a Home: once, at registration)."""
        from . import framework
        framework.bind(target, self.view(buffer, shape, dtype))

    @staticmethod
    def compute_fence():
        from . import framework
        framework.synchronize()

    def compute_marker(self):
        """Per-unit compute fences (framework.ComputeMarker), or None where the kernel fails."""
        with self._marker_lock:
            return self._compute_marker_locked()

    def _compute_marker_locked(self):
        if self._marker is None:
            from . import framework
            try:
                # Counting in the completion queue's fence block: a fence the scheduler
                # waits for (wake_at_fence) wakes the queue's wait directly.
                self._marker = framework.ComputeMarker(self.cq.fence_block)
            except Exception as e:   # fall back to whole-queue fences, and say so once
                import logging
                logging.getLogger("prefetchd").warning(
                    "per-unit compute fences unavailable (%s); using whole-queue fences", e)
                self._marker = False
        return self._marker or None

    @property
    def marker(self):
        return self._marker or None

    # transfers ------------------------------------------------------------------
    def start_load(self, key, block, nbytes, tag, verify, shape=None, dtype=None):
        if self.shared is not None and self.shared.start_load(key, block, nbytes, tag, verify):
            return
        self.load_stream.read(self.store, key, block, verify=verify, tag=tag, cq=self.cq)

    def start_store(self, key, block, nbytes, meta, tag, snapshot=True):
        # Write a snapshot, not the live block: compute or the user may write
        # the tensor while it is being stored, and a write that tears under
        # the checksum would fail verification. A write that races the
        # snapshot is caught by the daemon's generation check (dirty again).
        src = block
        if snapshot and nbytes:
            src = _native.aligned_buffer(nbytes, _ALIGN)
            self.store_stream.copy(src, block, nbytes)
            self._scratch[tag] = src
        self.store_stream.write(self.store, key, src, nbytes, meta, tag=tag, cq=self.cq)

    def start_verify(self, key, tag):
        # Reading the new version back through the checksummed read path proves
        # it is durable and intact before the device replica may be dropped.
        nbytes = self.store.info(key)["nbytes"]
        scratch = _native.aligned_buffer(max(nbytes, 1), _ALIGN)
        self._scratch[tag] = scratch
        self.store_stream.read(self.store, key, scratch, verify=True, tag=tag, cq=self.cq)

    def start_copy(self, kind, dst, src, nbytes, tag, shape=None, dtype=None):
        stream = self.store_stream if kind is TransferKind.D2H else self.load_stream
        stream.copy(dst, src, nbytes, tag=tag, cq=self.cq)

    def wait_completions(self, timeout):
        done = self.cq.wait(timeout)
        for c in done:
            self._scratch.pop(c.tag, None)
        return done

    def notify(self):
        self.cq.notify()

    def wake_at_fence(self, epoch):
        """Make wait_completions return once the compute marker's count reaches `epoch`
        (the fence kernel rings the queue's doorbell); True if that is a new target."""
        return self.cq.watch_fence(epoch)

    def close(self):
        if getattr(self, "shared", None) is not None:
            self.shared.close()
        for stream in {id(s): s for s in (self.load_stream, self.store_stream)}.values():
            stream.close()
        self._scratch.clear()
        self.store.close()
        self.host.close()
        self.device.close()
        if self._own_dir:
            shutil.rmtree(self.store.directory, ignore_errors=True)
