"""The Ascend backend: device memory is the NPU's; bytes move with MindSpore's own ops.

MindSpore 2.10's hierarchical-addressing HAL behind UpdateToDevice,
UpdateToRemote and Detach only logs "not implemented yet" on Ascend, so this
backend builds every move from the unified-addressing operators that do work
there, on a dedicated `mindspore.hal.Stream`:

    load   remote --native FileStore (O_DIRECT, checksummed)--> host staging --CopyToDevice--> device
    store  device --CopyToHost--> host --native FileStore write--> remote
    bind   SetData(target, device tensor)         free   Free(device tensor)

Each move runs on one copy thread in FIFO order; it records a `hal.Event` on
the copy stream and synchronises it before reporting the completion, so a
completion means the bytes have landed. This file cannot run without an
Ascend device; tests replace the MindSpore API (`AscendApi`) and say so in
their names.

ascend_vmm.AscendVmmBackend extends this backend with stable tensor addresses
(reserve/home/attach/detach over ACL's virtual memory calls).
"""
import collections
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from .. import _native
from .base import ALIGN as _ALIGN, Completion, HostAndStoreTiers, TransferKind, open_store


@dataclass
class AscendApi:
    """The MindSpore entry points this backend calls (replaceable in tests)."""
    Tensor: object
    CopyToDevice: object     # primitive class: CopyToDevice()(x, sync)
    CopyToHost: object
    Free: object
    SetData: object
    Stream: object           # mindspore.hal.Stream
    Event: object            # mindspore.hal.Event
    StreamCtx: object        # mindspore.hal.StreamCtx
    synchronize: object      # mindspore.hal.synchronize
    from_dlpack: object = None   # mindspore.utils.dlpack.from_dlpack: a tensor over device memory

    @classmethod
    def real(cls):
        import mindspore as ms
        from mindspore.ops import auto_generate as ag
        from mindspore.utils.dlpack import from_dlpack
        return cls(ms.Tensor, ag.CopyToDevice, ag.CopyToHost, ag.Free, ag.SetData,
                   ms.hal.Stream, ms.hal.Event, ms.hal.StreamCtx, ms.hal.synchronize, from_dlpack)


class DeviceBlock:
    """A reservation on the device and, once loaded, the device tensor holding it."""

    __slots__ = ("nbytes", "capacity", "tensor", "released", "__weakref__")
    _ids = iter(range(1, 1 << 62))

    def __init__(self, nbytes):
        self.nbytes = nbytes
        self.capacity = -(-nbytes // _ALIGN) * _ALIGN
        self.tensor = None
        self.released = False

    @property
    def address(self):
        return id(self.tensor) if self.tensor is not None else id(self)


def _typed(buffer, nbytes, shape, dtype):
    """A numpy view of `buffer` with the tensor's dtype and shape (a flat byte view without them)."""
    if dtype is None:
        return np.frombuffer(buffer, np.uint8, nbytes)
    dtype = np.dtype(dtype)
    return np.frombuffer(buffer, dtype, nbytes // dtype.itemsize).reshape(shape)


class AscendBackend(HostAndStoreTiers):
    name = "ascend"
    copy_contention = 0.0    # copies are DMA (aclrtMemcpyAsync): they take no compute

    def __init__(self, config, api=None):
        self.api = api or AscendApi.real()
        self._capacity = config.device_budget
        self._used = 0
        self._lock = threading.Lock()
        self.host = _native.HostPool(config.host_budget, _ALIGN)
        self.store = open_store(config)
        self.io_engine = self.store.engine
        self.cq = _native.CompletionQueue()       # wakes the scheduler; completions travel in _done
        self._done = collections.deque()
        self._jobs = queue.SimpleQueue()
        self.copy_stream = self.api.Stream()
        self._thread = threading.Thread(target=self._copy_worker, name="prefetchd-ascend-copy", daemon=True)
        self._thread.start()

    # memory ----------------------------------------------------------------------
    def alloc_device(self, nbytes, prefer=None):
        block = DeviceBlock(nbytes)
        with self._lock:
            if self._used + block.capacity > self._capacity:
                raise _native.OutOfSpace(f"device budget: {nbytes} bytes do not fit "
                                         f"({self._used} of {self._capacity} reserved)")
            self._used += block.capacity
        return block

    def free_device(self, block):
        if block.released:
            raise _native.Closed("block already released")
        if block.tensor is not None:
            self.api.Free()(block.tensor)
            block.tensor = None
        block.released = True
        with self._lock:
            self._used -= block.capacity

    def device_used(self):
        return self._used

    def device_capacity(self):
        return self._capacity


    # framework binding -------------------------------------------------------------
    @staticmethod
    def view(block, shape, dtype):
        raise TypeError("device memory on Ascend has no host view; use CopyToHost")

    def bind(self, target, block, shape, dtype):
        self.api.SetData()(target, block.tensor)

    def compute_fence(self):
        self.api.synchronize()

    marker = None           # compute fences on Ascend come from hal events (not yet per unit)

    def compute_marker(self):
        return None

    # transfers -------------------------------------------------------------------
    def start_load(self, key, block, nbytes, tag, verify, shape=None, dtype=None):
        self._jobs.put((self._load, (key, block, nbytes, verify, shape, dtype), tag, TransferKind.LOAD))

    def start_store(self, key, block, nbytes, meta, tag, snapshot=True):
        self._jobs.put((self._store, (key, block, nbytes, meta), tag, TransferKind.STORE))

    def start_verify(self, key, tag):
        self._jobs.put((self._verify, (key,), tag, TransferKind.VERIFY))

    def start_copy(self, kind, dst, src, nbytes, tag, shape=None, dtype=None):
        self._jobs.put((self._copy, (kind, dst, src, nbytes, shape, dtype), tag, kind))

    def wait_completions(self, timeout):
        self.cq.wait(timeout if not self._done else 0)
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def notify(self):
        self.cq.notify()

    # the copy thread ---------------------------------------------------------------
    def _copy_worker(self):
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, args, tag, kind = job
            start = time.monotonic_ns()
            try:
                nbytes = fn(*args)
                status, message = 0, ""
            except _native.NativeError as e:
                nbytes, status, message = 0, getattr(e, "status", 5) or 5, str(e)
            except Exception as e:       # report, never kill the copy thread
                nbytes, status, message = 0, 5, f"{kind.value} failed: {e!r}"
            self._done.append(Completion(tag, status, message, nbytes, 0, start, time.monotonic_ns()))
            self.cq.notify()

    def _to_device(self, host_array, block):
        with self.api.StreamCtx(self.copy_stream):
            block.tensor = self.api.CopyToDevice()(self.api.Tensor.from_numpy(host_array), False)
            event = self.api.Event()
            event.record(self.copy_stream)
        event.synchronize()

    def _to_host(self, block):
        with self.api.StreamCtx(self.copy_stream):
            host = self.api.CopyToHost()(block.tensor, False)
            event = self.api.Event()
            event.record(self.copy_stream)
        event.synchronize()
        return np.ascontiguousarray(host.asnumpy()).reshape(-1).view(np.uint8)

    def _load(self, key, block, nbytes, verify, shape, dtype):
        if not isinstance(block, DeviceBlock):      # a host destination (STAGE): read straight in
            self.store.read_sync(key, block, verify)
            return nbytes
        staging = self.host.alloc(nbytes)
        try:
            self.store.read_sync(key, staging, verify)
            self._to_device(_typed(staging, nbytes, shape, dtype), block)
        finally:
            staging.release()
        return nbytes

    def _store(self, key, block, nbytes, meta):
        data = self._to_host(block) if isinstance(block, DeviceBlock) else block
        self.store.write_sync(key, data, nbytes, meta)
        return nbytes

    def _verify(self, key):
        nbytes = self.store.info(key)["nbytes"]
        scratch = _native.aligned_buffer(max(nbytes, 1), _ALIGN)
        self.store.read_sync(key, scratch, True)
        return nbytes

    def _copy(self, kind, dst, src, nbytes, shape, dtype):
        if kind is TransferKind.H2D:
            self._to_device(_typed(src, nbytes, shape, dtype), dst)
        else:
            np.frombuffer(dst, np.uint8, nbytes)[:] = self._to_host(src)[:nbytes]
        return nbytes

    def close(self):
        self._jobs.put(None)
        self._thread.join()
        self.store.close()
        self.host.close()
