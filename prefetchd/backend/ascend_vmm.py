"""The Ascend backend with stable tensor addresses, over ACL's virtual memory calls.

MindSpore 2.10 calls aclrtReserveMemAddress / aclrtMallocPhysical / aclrtMapMem
only inside its C++ memory pool and exposes none of them to Python, so
`AclVmm` reaches them with ctypes on libascendcl.so, loaded on first use (the
module imports on any machine). Granularity is 2 MiB: every virtual address,
size and physical handle here is a multiple of it.

    reserve(n)        aclrtReserveMemAddress                 address space, no memory
    alloc_device(n)   aclrtMallocPhysical + a scratch VA + aclrtMapMem   filled there (aclrtMemcpy)
    attach(home, b)   aclrtUnmapMem(scratch), aclrtMapMem(home)          same physical memory
    detach(home, b)   aclrtUnmapMem(home), aclrtMapMem(scratch)          device reads of home fault
    bind(t, home)     SetData(t, from_dlpack(capsule over home))          once per tensor
    free_device(b)    aclrtUnmapMem, aclrtReleaseMemAddress, aclrtFreePhysical

Every device block is a mapped block here, so the daemon's older flow (bind
a block's tensor per load) works too: `bind` with a block views its current
address. The caller fences compute (compute_fence) before detach or free, as
on CPU: unmapping memory a queued kernel still reads faults on the device.
"""
import ctypes
import threading

import numpy as np

from .. import _native
from . import dlpack
from .ascend import AscendBackend
from .base import ALIGN as _ALIGN, TransferKind

GRANULARITY = 2 << 20

# acl enums (acl_rt.h)
_ACL_MEM_HANDLE_TYPE_NONE = 0
_ACL_MEM_ALLOCATION_TYPE_PINNED = 0
_ACL_HBM_MEM_HUGE = 4
_ACL_MEM_LOCATION_TYPE_DEVICE = 1
MEMCPY_HOST_TO_DEVICE = 1
MEMCPY_DEVICE_TO_HOST = 2


class MemLocation(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint32), ("type", ctypes.c_int)]


class PhysicalMemProp(ctypes.Structure):
    """aclrtPhysicalMemProp."""
    _fields_ = [("handleType", ctypes.c_int), ("allocationType", ctypes.c_int), ("memAttr", ctypes.c_int),
                ("location", MemLocation), ("reserve", ctypes.c_uint64)]


def round_up(nbytes):
    return -(-max(nbytes, 1) // GRANULARITY) * GRANULARITY


class AclVmm:
    """The ACL calls of the stable-address device tier; `lib` is replaceable in tests.

    Every call raises native NativeError naming the ACL function and its error
    code when ACL returns non-zero.
    """

    def __init__(self, device_id=0, lib=None, lib_name="libascendcl.so"):
        self.device_id = device_id
        self._lib = lib
        self._lib_name = lib_name
        self._lock = threading.Lock()
        self._thread_ready = threading.local()

    @property
    def lib(self):
        with self._lock:
            if self._lib is None:
                try:
                    self._lib = ctypes.CDLL(self._lib_name)
                except OSError as e:
                    raise _native.NativeError(
                        f"cannot load {self._lib_name} (the Ascend runtime) for device memory mapping: {e}") from None
            return self._lib

    def _call(self, name, *args):
        rc = getattr(self.lib, name)(*args)
        if rc != 0:
            raise _native.NativeError(f"{name} failed with ACL error {rc}")

    def _bind_thread(self):
        # ACL keeps the current device per thread; copy threads start without one.
        if not getattr(self._thread_ready, "done", False):
            self._call("aclrtSetDevice", ctypes.c_int32(self.device_id))
            self._thread_ready.done = True

    def reserve(self, nbytes):
        """Virtual address space only; returns the address."""
        va = ctypes.c_void_p()
        self._call("aclrtReserveMemAddress", ctypes.byref(va), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                   None, ctypes.c_uint64(0))
        return va.value

    def release(self, va):
        self._call("aclrtReleaseMemAddress", ctypes.c_void_p(va))

    def malloc_physical(self, nbytes):
        """Device memory (HBM, huge pages) with no address; returns its handle."""
        prop = PhysicalMemProp(_ACL_MEM_HANDLE_TYPE_NONE, _ACL_MEM_ALLOCATION_TYPE_PINNED, _ACL_HBM_MEM_HUGE,
                               MemLocation(self.device_id, _ACL_MEM_LOCATION_TYPE_DEVICE), 0)
        handle = ctypes.c_void_p()
        self._call("aclrtMallocPhysical", ctypes.byref(handle), ctypes.c_size_t(nbytes), ctypes.byref(prop),
                   ctypes.c_uint64(0))
        return handle.value

    def free_physical(self, handle):
        self._call("aclrtFreePhysical", ctypes.c_void_p(handle))

    def map(self, va, nbytes, handle):
        self._call("aclrtMapMem", ctypes.c_void_p(va), ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                   ctypes.c_void_p(handle), ctypes.c_uint64(0))

    def unmap(self, va):
        self._call("aclrtUnmapMem", ctypes.c_void_p(va))

    def memcpy(self, dst, src, nbytes, kind):
        """Synchronous copy between a host pointer and a mapped device address."""
        self._bind_thread()
        self._call("aclrtMemcpy", ctypes.c_void_p(dst), ctypes.c_size_t(nbytes), ctypes.c_void_p(src),
                   ctypes.c_size_t(nbytes), ctypes.c_int(kind))


# ---------------------------------------------------------------- ranges, homes, blocks

class DeviceRange:
    """Reserved device address space (no memory); homes are GRANULARITY-aligned slices of it."""

    def __init__(self, vmm, nbytes):
        self.nbytes = round_up(nbytes)
        self.address = vmm.reserve(self.nbytes)
        self._vmm = vmm
        self._homes = []             # homes cut so far (never overlapping)
        self.closed = False

    def slice(self, offset, nbytes):
        if self.closed:
            raise _native.Closed("virtual range is closed")
        if offset % GRANULARITY:
            raise ValueError(f"home offset {offset} is not a multiple of the Ascend mapping "
                             f"granularity {GRANULARITY}")
        capacity = round_up(nbytes)
        if offset + capacity > self.nbytes:
            raise ValueError(f"home [{offset}, +{capacity}) does not fit in the virtual range of "
                             f"{self.nbytes} bytes")
        for h in self._homes:
            if h.offset < offset + capacity and offset < h.offset + h.capacity:
                raise ValueError(f"home [{offset}, +{capacity}) overlaps the home at offset {h.offset}")
        home = DeviceHome(self, offset, nbytes, capacity)
        self._homes.append(home)
        return home

    def close(self):
        """Release the address space; every home must be detached first."""
        if self.closed:
            return
        if any(h.attached for h in self._homes):
            raise _native.NativeError("virtual range still has attached homes; detach them first")
        self.closed = True
        self._vmm.release(self.address)


class DeviceHome:
    """One tensor's device address for life; `block` is the mapped block there, if any."""

    def __init__(self, vrange, offset, nbytes, capacity):
        self.range = vrange
        self.offset = offset
        self.address = vrange.address + offset
        self.nbytes = nbytes
        self.capacity = capacity
        self.block = None

    @property
    def attached(self):
        return self.block is not None


class MappedBlock:
    """Physical device memory, mapped at its own scratch address unless attached to a home."""

    __slots__ = ("nbytes", "capacity", "handle", "scratch", "home", "released", "__weakref__")

    def __init__(self, vmm, nbytes):
        self.nbytes = nbytes
        self.capacity = round_up(nbytes)
        self.handle = vmm.malloc_physical(self.capacity)
        try:
            self.scratch = vmm.reserve(self.capacity)
            try:
                vmm.map(self.scratch, self.capacity, self.handle)
            except BaseException:
                vmm.release(self.scratch)
                raise
        except BaseException:
            vmm.free_physical(self.handle)
            raise
        self.home = None
        self.released = False

    @property
    def address(self):
        """Where the bytes are now: the home while attached, else the scratch mapping."""
        return self.home.address if self.home is not None else self.scratch


_DEVICE = (MappedBlock, DeviceHome)


# ---------------------------------------------------------------- the backend

class AscendVmmBackend(AscendBackend):
    granularity = GRANULARITY     # home offsets and sizes are multiples of it

    def __init__(self, config, api=None, vmm=None):
        self.vmm = vmm or AclVmm()
        super().__init__(config, api=api)

    # memory ------------------------------------------------------------------------
    @staticmethod
    def block_bytes(nbytes):
        """A device block is whole 2 MiB granules (the daemon budgets with this)."""
        return round_up(nbytes)

    def alloc_device(self, nbytes, prefer=None):
        capacity = round_up(nbytes)
        with self._lock:
            if self._used + capacity > self._capacity:
                raise _native.OutOfSpace(f"device budget: {nbytes} bytes do not fit "
                                         f"({self._used} of {self._capacity} reserved)")
            self._used += capacity
        try:
            return MappedBlock(self.vmm, nbytes)
        except BaseException:
            with self._lock:
                self._used -= capacity
            raise

    def free_device(self, block):
        if block.released:
            raise _native.Closed("block already released")
        if block.home is not None:
            raise _native.NativeError("block is attached to a home; detach it first")
        self.vmm.unmap(block.scratch)
        self.vmm.release(block.scratch)
        self.vmm.free_physical(block.handle)
        block.released = True
        with self._lock:
            self._used -= block.capacity

    # stable addresses --------------------------------------------------------------
    def reserve(self, nbytes):
        return DeviceRange(self.vmm, nbytes)

    @staticmethod
    def home(vrange, offset, nbytes):
        return vrange.slice(offset, nbytes)

    @staticmethod
    def _check_pair(home, block, verb):
        if not isinstance(block, MappedBlock) or not isinstance(home, DeviceHome):
            raise ValueError(f"{verb}: needs a DeviceHome and a block of this backend, got {home!r}, {block!r}")
        if block.released:
            raise _native.Closed("block already released")
        if block.capacity < home.capacity or block.nbytes < home.nbytes:
            raise ValueError(f"{verb}: block of {block.nbytes} bytes (capacity {block.capacity}) cannot "
                             f"back a home of {home.nbytes} bytes ({home.capacity} mapped)")

    def attach(self, home, block):
        """Map the block's physical memory at the home (its scratch mapping goes)."""
        self._check_pair(home, block, "attach")
        if home.block is not None:
            raise ValueError(f"attach: the home at {home.address:#x} already has a block attached")
        if block.home is not None:
            raise ValueError(f"attach: the block is already attached to the home at {block.home.address:#x}")
        self.vmm.unmap(block.scratch)
        try:
            self.vmm.map(home.address, home.capacity, block.handle)
        except BaseException:
            self.vmm.map(block.scratch, block.capacity, block.handle)
            raise
        home.block, block.home = block, home

    def detach(self, home, block):
        """Unmap the home (device reads of it fault) and map the block back at its scratch address."""
        if getattr(home, "block", None) is not block:
            raise ValueError(f"detach: the home at {home.address:#x} does not hold this block")
        self._check_pair(home, block, "detach")
        self.vmm.unmap(home.address)
        self.vmm.map(block.scratch, block.capacity, block.handle)
        home.block, block.home = None, None

    @staticmethod
    def written(home):
        """NPU kernels write device memory that no host page protection sees, so an
        in-place write by compute is not noticed here (docs/stable-addresses.md): only
        writes through the Python API mark a tensor dirty on this backend."""
        return False

    # framework binding -------------------------------------------------------------
    def bind(self, target, buffer, shape, dtype):
        """Point `target` at a home (once, at registration) or at a block's current address."""
        if not isinstance(buffer, _DEVICE):
            raise TypeError(f"bind: needs a DeviceHome or a block of this backend, got {buffer!r}")
        capsule = dlpack.dlpack_capsule(buffer.address, shape, dtype, dlpack.KDL_EXT_DEV,
                                        self.vmm.device_id, owner=buffer)
        self.api.SetData()(target, self.api.from_dlpack(capsule))

    # transfers (run on the copy thread) ---------------------------------------------
    def _load(self, key, block, nbytes, verify, shape, dtype):
        if not isinstance(block, _DEVICE):          # a host destination (STAGE): read straight in
            self.store.read_sync(key, block, verify)
            return nbytes
        staging = self.host.alloc(nbytes)
        try:
            self.store.read_sync(key, staging, verify)
            self.vmm.memcpy(block.address, staging.address, nbytes, MEMCPY_HOST_TO_DEVICE)
        finally:
            staging.release()
        return nbytes

    def _store(self, key, block, nbytes, meta):
        data = block
        if isinstance(block, _DEVICE):
            data = _native.aligned_buffer(max(nbytes, 1), _ALIGN)
            self.vmm.memcpy(data.address, block.address, nbytes, MEMCPY_DEVICE_TO_HOST)
        self.store.write_sync(key, data, nbytes, meta)
        return nbytes

    def _copy(self, kind, dst, src, nbytes, shape, dtype):
        if kind is TransferKind.H2D:
            host = np.frombuffer(src, np.uint8, nbytes)
            self.vmm.memcpy(dst.address, host.ctypes.data, nbytes, MEMCPY_HOST_TO_DEVICE)
        else:
            host = np.frombuffer(dst, np.uint8, nbytes)
            self.vmm.memcpy(host.ctypes.data, src.address, nbytes, MEMCPY_DEVICE_TO_HOST)
        return nbytes
