"""The Backend protocol the daemon schedules against.

A backend owns three tiers (device allocator, host allocator, remote store)
and copy streams. Every transfer is asynchronous: `start_*` enqueues it on a
copy stream and returns at once; its completion later comes out of
`wait_completions()` carrying the caller's `tag`. The scheduler blocks there
(no polling) and is woken early by `notify()` when a request arrives.
"""
import functools
from dataclasses import dataclass
from enum import Enum
from typing import Protocol


class TransferKind(str, Enum):
    LOAD = "load"      # remote -> device
    STORE = "store"    # device -> remote
    H2D = "h2d"        # host -> device
    D2H = "d2h"        # device -> host
    VERIFY = "verify"  # re-read of a stored version to prove it durable and intact
    STAGE = "stage"    # remote -> host (a host replica of a stored tensor)


@dataclass(frozen=True)
class Completion:
    """A finished transfer; same fields as the native engine's Completion."""
    tag: int
    status: int          # 0 ok, errno > 0, native STATUS_* < 0
    message: str = ""
    nbytes: int = 0
    result: int = 0
    start_ns: int = 0
    end_ns: int = 0


class Backend(Protocol):
    name: str
    io_engine: str

    # memory
    def alloc_device(self, nbytes: int, prefer=None): ...  # -> block (at address `prefer` if free),
                                                            # or raise native OutOfSpace
    def free_device(self, block) -> None: ...
    def device_used(self) -> int: ...                 # bytes reserved (rounded to alignment)
    def device_capacity(self) -> int: ...
    def block_bytes(self, nbytes: int) -> int: ...    # what a request of nbytes reserves
    copy_contention: float                            # compute seconds a second of host->device
                                                      # copying costs (cpu memcpy: 1; DMA: 0), plan.Inputs
    def alloc_host(self, nbytes: int): ...
    def free_host(self, block) -> None: ...
    def host_used(self) -> int: ...

    # stable addresses (docs/stable-addresses.md): a tensor's framework view
    # points at its home for life; residency maps a block's pages there or not
    granularity: int                                  # home offsets/sizes are multiples of it
                                                      # (CPU: 4 KiB page; Ascend VMM: 2 MiB)
    def reserve(self, nbytes: int): ...               # -> a virtual range: address space, no memory
    def home(self, vrange, offset: int, nbytes: int): ...  # -> Home at page-aligned offset of vrange
    def attach(self, home, block) -> None: ...        # block's bytes now read/written at home
    def detach(self, home, block) -> None: ...        # back to block; home faults until re-attached
    # optional (cpu: the host and device tiers are the same RAM; docs/stable-addresses.md,
    # "Zero-copy tiers"). A backend without them copies host -> device (fill_from_host).
    def lends(self, host_block) -> bool: ...          # attach_lent can take this host block's pages
    def attach_lent(self, home, block, host_block) -> None: ...  # host_block's pages move to home
                                                      # (no byte copied); block is attached holding
                                                      # none, host_block holds none until detach_lent
    def detach_lent(self, home, block, host_block) -> None: ...  # the home's pages back to host_block
    parks: bool                                       # optional, with park/attach_parked/unpark:
    def park(self, home, block) -> None: ...          # detach the slot, the home keeps the lent
                                                      # pages unreadable (they are the host tier's)
    def attach_parked(self, home, block) -> None: ... # parked pages readable again, block the slot
    def unpark(self, home, host_block=None) -> None: ...  # parked pages to host_block, or freed
    def written(self, home) -> bool: ...              # compute wrote the attached home in place since
                                                      # the last True (cpu: write faults); False where
                                                      # the backend cannot see such writes

    # framework binding
    def view(self, buffer, shape, dtype): ...         # numpy view of a block or home, no copy
    def bind(self, target, buffer, shape, dtype) -> None: ...  # once per tensor, with its Home
    def compute_fence(self) -> None: ...              # all dispatched compute has finished
    def compute_marker(self): ...                     # per-unit fences (mark/reached/wait) or None
    marker: object                                    # the marker once created, else None
    def wake_at_fence(self, epoch) -> bool: ...       # with a marker: wait_completions returns once
                                                      # it reaches epoch (True: a new target)

    # transfers (asynchronous; completions carry `tag`)
    # shape/dtype describe the tensor the bytes belong to (a device copy needs them on Ascend)
    def start_load(self, key: str, block, nbytes: int, tag: int, verify: bool,
                   shape=None, dtype=None) -> None: ...
    def start_store(self, key: str, block, nbytes: int, meta: bytes, tag: int,
                    snapshot: bool = True) -> None: ...   # block: a block or an attached Home
    def start_verify(self, key: str, tag: int) -> None: ...
    def start_copy(self, kind: TransferKind, dst, src, nbytes: int, tag: int,
                   shape=None, dtype=None) -> None: ...
    # host -> device by copy (DMA on an accelerator): the completion carries `tag`, and
    # host_block keeps its bytes. Where the tiers are the same RAM a load with a home moves
    # pages instead (attach_lent above).
    def fill_from_host(self, dst, host_block, nbytes: int, tag: int,
                       shape=None, dtype=None) -> None: ...
    def wait_completions(self, timeout: float | None) -> list: ...
    def notify(self) -> None: ...

    # remote tier
    def store_contains(self, key: str) -> bool: ...
    def store_info(self, key: str) -> dict: ...
    def store_bytes(self) -> int: ...
    def store_remove(self, key: str) -> None: ...      # its file (every version) is deleted
    def write_sync(self, key: str, data, meta: bytes = b"") -> None: ...
    def read_sync(self, key: str, dst) -> None: ...

    def close(self) -> None: ...


ALIGN = 4096   # device blocks, host blocks and store extents are 4 KiB aligned (O_DIRECT)
_PROBE_BYTES = 16 << 20


def _probe_buffer():
    """A 16 MiB aligned buffer, written once (so its pages are faulted in before timing)."""
    from .. import _native
    buffer = _native.aligned_buffer(_PROBE_BYTES)
    memoryview(buffer)[:] = bytes(range(256)) * (_PROBE_BYTES // 256)
    return buffer


def _bytes_per_second(work):
    """_PROBE_BYTES over the best of 3 timed calls of `work()`."""
    import time
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t)
    return _PROBE_BYTES / max(best, 1e-9)


@functools.cache
def checksum_rate():
    """Bytes per second of the native CRC32C that verifies every read from the store, on
    this host's CPU (best of 3 over 16 MiB, measured once per process: ~5 ms)."""
    from .. import _native
    buffer = _probe_buffer()
    return _bytes_per_second(lambda: _native.crc32c(buffer, 0))


@functools.cache
def copy_rate():
    """Bytes per second of one host->device copy on the cpu backend: the native
    bulk_copy that copy streams run (streaming stores), between two buffers, best of 3
    over 16 MiB, measured once per process (~10 ms). The CPU work of a copy, with
    nothing running beside it. (Not a memoryview slice copy: that is glibc's memcpy,
    2.4 against 9.6 GB/s here, docs/performance.md.)"""
    from .. import _native
    src, dst = _probe_buffer(), _probe_buffer()
    return _bytes_per_second(lambda: _native.bulk_copy(dst, src))


# What `prefetchd stage --shard` writes at the root of a sharded store (staging/shards.py):
# the root holds rank_N/ stores, and is not a store itself.
SHARDS_FILE = "prefetchd-shards.json"
# A FileStore's flock file in its directory: held while a daemon (or a stage) has the store open.
STORE_LOCK = ".pfd-lock"
# The ending of a FileStore's tensor files (`<name>-<hash>.<version>.pfd`, flat in its directory).
STORE_SUFFIX = ".pfd"


def open_store(config):
    """The remote tier of a backend: a native FileStore in config.store_dir (or a private temp dir).

    The directory is created 0700. One FileStore per directory at a time: a
    directory another store holds (this process or another) is refused.
    Raises StorageError (in use, unwritable, cannot be created) or ConfigError
    (a value the store refuses), both naming `store_dir`; a temp dir made here
    is removed again when the open fails. Each file the store's recovery set
    aside (`FileStore.quarantined`) is logged as a WARNING on "prefetchd.store".
    """
    import logging
    import os
    import shutil
    import tempfile
    from .. import _native
    from ..errors import ConfigError
    from ..errors import StorageError
    if any(part.strip() for part in os.environ.get("PREFETCHD_FAULTS", "").split(";")):   # a test switch,
        # never silently on in production
        logging.getLogger("prefetchd.store").warning(
            "PREFETCHD_FAULTS=%s is set: this process's store reads and writes fail or stall on purpose "
            "(fault injection for tests); unset it to run normally", os.environ["PREFETCHD_FAULTS"])
    temporary = not config.store_dir
    directory = tempfile.mkdtemp(prefix="prefetchd-store-") if temporary else config.store_dir
    try:
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise StorageError(f"store_dir {directory}: is not a directory (give a directory prefetchd may "
                               f"create or own)")
        if os.path.exists(os.path.join(directory, SHARDS_FILE)):
            # Opened as a store, it would look empty and take a lock file that the next
            # `stage --shard` refuses as foreign.
            raise StorageError(f"store_dir {directory}: is a sharded store ({SHARDS_FILE}); a rank's daemon "
                               f"opens {os.path.join(directory, 'rank_N')}: build its config with "
                               f"prefetchd.ranks.rank_config(config) inside the rank's process (msrun), "
                               f"or give that directory")
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as e:
            raise StorageError(f"store_dir {directory}: cannot create it: {e.strerror}") from None
        try:
            store = _native.FileStore(directory, engine=config.io_engine, direct=config.direct_io,
                                      block_size=config.io_block_size, queue_depth=config.io_queue_depth,
                                      io_threads=config.io_threads, fsync=config.fsync)
            for q in store.quarantined:
                logging.getLogger("prefetchd.store").warning(
                    "store_dir %s: recovery quarantined %s (%s)%s", directory, q["path"], q["reason"],
                    f"; moved to {q['moved_to']}" if q["moved_to"] else "")
            return store
        except ValueError as e:
            raise ConfigError(f"store_dir {directory}: {e}") from None
        except _native.NativeError as e:
            raise StorageError(f"store_dir {directory}: {e}") from e
    except BaseException:
        if temporary:
            shutil.rmtree(directory, ignore_errors=True)
        raise


class HostAndStoreTiers:
    """The host pool and remote store part of a backend; both backends share it.

    Needs `self.host` (native HostPool) and `self.store` (native FileStore).
    """

    @staticmethod
    def block_bytes(nbytes):
        return -(-nbytes // ALIGN) * ALIGN

    def alloc_host(self, nbytes):
        return self.host.alloc(nbytes)

    def free_host(self, block):
        block.release()

    def host_used(self):
        return self.host.used

    def fill_from_host(self, dst, host_block, nbytes, tag, shape=None, dtype=None):
        """Host -> device by copy (the accelerator backends: DMA beside compute); the
        cpu backend moves a load's pages straight under its home instead (attach_lent)."""
        self.start_copy(TransferKind.H2D, dst, host_block, nbytes, tag, shape=shape, dtype=dtype)

    def host_capacity(self):
        return self.host.budget

    def store_contains(self, key):
        return self.store.contains(key)

    def store_info(self, key):
        return self.store.info(key)

    def store_bytes(self):
        return self.store.bytes_stored()

    def store_remove(self, key):
        self.store.remove(key)

    def write_sync(self, key, data, meta=b""):
        self.store.write_sync(key, data, -1, meta)

    def read_sync(self, key, dst):
        self.store.read_sync(key, dst, True)
