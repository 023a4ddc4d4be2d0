"""A backend with no threads and no I/O, for driving the scheduler core step by step.

Transfers are queued, not run: `complete()` performs the queued ones (in order,
or only those a test picks) and returns their completions, which the test
feeds to `Scheduler.step`. Memory is plain bytearrays with the real byte
accounting (4 KiB rounding, exact budgets). `fail_next(op, status)` makes the
next transfer of that kind fail; `raise_at = k` makes the k-th backend call raise.
"""
import errno

from prefetchd import _native
from prefetchd.backend.base import Completion, TransferKind

ALIGN = 4096


def rounded(n):
    return -(-n // ALIGN) * ALIGN


class Block(bytearray):
    _next = 1

    def __init__(self, nbytes):
        super().__init__(nbytes)
        self.capacity = rounded(nbytes)
        self.address = Block._next * (1 << 32)
        Block._next += 1


class Home:
    """A stand-in home: shows its attached block's bytes; a test sets `written` where
    compute would have written it in place (the cpu backend's write watch)."""

    def __init__(self):
        self.block, self.written = None, False
        self.parked = None         # the bytes a park left here (the fake's PROT_NONE pages)

    def __getitem__(self, index):
        return self.block[index]

    def __setitem__(self, index, value):
        self.block[index] = value


class FakeBackend:
    name = "fake"
    io_engine = "none"
    marker = None

    def __init__(self, device_budget, host_budget=0):
        self.capacity, self.host_budget = device_budget, host_budget
        self.used = self.host_in_use = 0
        self.store = {}                  # key -> bytes (verified copies)
        self.queued = []                 # (kind, tag, run) not yet performed
        self.fail = {}                   # kind -> status for its next transfer
        self.raise_at = None             # index (in self.calls) of the call that raises
        self.calls = []
        self.on_fence = None             # fn() run inside a whole-queue compute fence

    # -- test controls
    def fail_next(self, kind, status=errno.EIO):
        self.fail[kind] = status

    def _call(self, method):
        self.calls.append(method)
        if len(self.calls) - 1 == self.raise_at:
            raise RuntimeError(f"injected failure in call {self.raise_at} ({method})")

    def complete(self, pick=None):
        """Run queued transfers (all, or those whose kind is in `pick`); their completions."""
        done, keep = [], []
        for kind, tag, run in self.queued:
            if pick is not None and kind not in pick:
                keep.append((kind, tag, run))
                continue
            status = self.fail.pop(kind, 0)
            if status == 0:
                run()
            done.append(Completion(tag, status, "injected" if status else "", 0, 0, 0, 1000))
        self.queued = keep
        return done

    # -- memory
    def alloc_device(self, nbytes, prefer=None):
        self._call("alloc_device")
        if self.used + rounded(nbytes) > self.capacity:
            raise _native.OutOfSpace("fake arena full")
        self.used += rounded(nbytes)
        return Block(nbytes)

    def free_device(self, block):
        self._call("free_device")
        self.used -= block.capacity

    def device_used(self):
        return self.used

    def device_capacity(self):
        return self.capacity

    block_bytes = staticmethod(rounded)

    def alloc_host(self, nbytes):
        self._call("alloc_host")
        if self.host_in_use + rounded(nbytes) > self.host_budget:
            raise _native.OutOfSpace("fake host pool full")
        self.host_in_use += rounded(nbytes)
        return Block(nbytes)

    def free_host(self, block):
        self.host_in_use -= block.capacity

    def host_used(self):
        return self.host_in_use

    def host_capacity(self):
        return self.host_budget

    # -- homes (records get one only where a test gives it) and write watches
    @staticmethod
    def attach(home, block):
        assert home.block is None
        home.block = block

    @staticmethod
    def detach(home, block):
        assert home.block is block
        home.block = None

    @staticmethod
    def written(home):
        was, home.written = home.written, False
        return was and home.block is not None

    # -- binding and fences (nothing to bind: records have no framework tensor)
    def compute_fence(self):
        if self.on_fence is not None:
            self.on_fence()

    def compute_marker(self):
        return None

    def notify(self):
        pass

    # -- transfers
    def start_load(self, key, dst, nbytes, tag, verify, shape=None, dtype=None):
        self._call("start_load")

        def run():
            dst[:nbytes] = self.store[key]
        self.queued.append((TransferKind.LOAD, tag, run))

    def start_store(self, key, src, nbytes, meta, tag, snapshot=True):
        self._call("start_store")
        data = bytes(src[:nbytes])              # the snapshot
        self.queued.append((TransferKind.STORE, tag, lambda: self.store.__setitem__(key, data)))

    def start_verify(self, key, tag):
        self._call("start_verify")
        self.queued.append((TransferKind.VERIFY, tag, lambda: None))

    def start_copy(self, kind, dst, src, nbytes, tag, shape=None, dtype=None):
        self._call("start_copy")

        def run():
            dst[:nbytes] = bytes(memoryview(src).cast("B")[:nbytes])
        self.queued.append((kind, tag, run))

    def fill_from_host(self, dst, host_block, nbytes, tag, shape=None, dtype=None):
        self._call("fill_from_host")
        self.start_copy(TransferKind.H2D, dst, host_block, nbytes, tag)

    lending = False    # True: loads with a home move pages (the cpu backend's attach_lent)

    def lends(self, host_block):
        return self.lending

    def attach_lent(self, home, block, host_block):
        # A move: the bytes are at the home now and the host block holds zeros, so a core
        # that read a lent host block would load zeros, not the tensor.
        self._call("attach_lent")
        assert home.block is None
        block[:len(host_block)] = host_block
        host_block[:] = bytes(len(host_block))
        home.block = block

    def detach_lent(self, home, block, host_block):
        self._call("detach_lent")
        assert home.block is block
        host_block[:] = block[:len(host_block)]
        block[:] = bytes(len(block))
        home.block = None

    parks = False      # True (with lending): the drop leaves the bytes at the home (the cpu park)

    def park(self, home, block):
        # The home keeps the bytes but shows none (reading it raises, like PROT_NONE).
        self._call("park")
        assert home.block is block
        home.parked, home.block = bytes(block), None
        block[:] = bytes(len(block))

    def attach_parked(self, home, block):
        self._call("attach_parked")
        assert home.block is None and home.parked is not None
        block[:len(home.parked)] = home.parked
        home.parked, home.block = None, block

    mapped = ()        # blocks a test marks as mapping a shared-tier block (the cpu parks_mapping)

    def parks_mapping(self, block):
        return any(block is b for b in self.mapped)

    def unpark(self, home, host_block=None):
        self._call("unpark")
        assert home.parked is not None
        if host_block is not None:
            host_block[:] = home.parked[:len(host_block)]
        home.parked = None

    def store_contains(self, key):
        return key in self.store

    def close(self):
        pass
