"""The Ascend backend's dispatch, run WITHOUT Ascend hardware.

This machine has no NPU, so MindSpore's Ascend-only entry points
(CopyToDevice/CopyToHost/Free/SetData and hal.Stream/Event) are replaced by
fakes that record each call and keep device tensors as numpy copies. What is
real: the daemon, the native file store, the copy thread, the data path.

The stable-address backend (AscendVmmBackend) is tested the same way over a
fake libascendcl (FakeAcl) that receives AclVmm's real ctypes arguments.
"""
import ctypes

import numpy as np
import pytest

from prefetchd import Config, Daemon, _native
from prefetchd.backend.ascend import AscendApi, AscendBackend
from prefetchd.backend.ascend_vmm import AclVmm, AscendVmmBackend
from prefetchd.backend.base import TransferKind
from prefetchd.backend.dlpack import read_capsule


class FakeDeviceTensor:
    def __init__(self, array):
        self.array = np.array(array, copy=True)
        self.freed = False


class FakeHostTensor:
    def __init__(self, array):
        self.array = array

    def asnumpy(self):
        return self.array


def fake_api(log):
    class Tensor:
        @staticmethod
        def from_numpy(array):
            return FakeHostTensor(array)

    class CopyToDevice:
        def __call__(self, x, sync=False):
            log.append(("CopyToDevice", x.array.dtype.name, tuple(x.array.shape)))
            return FakeDeviceTensor(x.array)

    class CopyToHost:
        def __call__(self, x, sync=False):
            assert not x.freed, "CopyToHost of a freed device tensor"
            log.append(("CopyToHost",))
            return FakeHostTensor(x.array.copy())

    class Free:
        def __call__(self, x):
            assert not x.freed, "double Free"
            x.freed = True
            log.append(("Free",))

    class SetData:
        bound = {}

        def __call__(self, target, value):
            assert not value.freed, "SetData to a freed device tensor"
            SetData.bound[id(target)] = value
            log.append(("SetData",))

    class Stream:
        pass

    class Event:
        def record(self, stream):
            log.append(("Event.record",))

        def synchronize(self):
            log.append(("Event.synchronize",))

    class StreamCtx:
        def __init__(self, stream):
            pass

        def __enter__(self):
            log.append(("StreamCtx",))

        def __exit__(self, *exc):
            return False

    def synchronize():
        log.append(("hal.synchronize",))

    return AscendApi(Tensor, CopyToDevice, CopyToHost, Free, SetData, Stream, Event, StreamCtx,
                     synchronize), SetData.bound


@pytest.fixture
def ascend(store_dir):
    log = []
    api, bound = fake_api(log)
    config = Config.load(env={}, backend="ascend", device_budget="8MiB", store_dir=store_dir)
    daemon = Daemon(config, backend=AscendBackend(config, api=api)).start()
    yield daemon, log, bound
    daemon.close()


def test_ascend_dispatch_without_hardware_load_goes_through_copy_stream_and_event(ascend, make_param):
    daemon, log, bound = ascend
    values = np.arange(1000, dtype=np.float32).reshape(10, 100)
    p = make_param(values, "w")
    h = daemon.register(p, tier="remote")
    log.clear()
    daemon.prefetch(h).result(10)
    assert log == [("StreamCtx",), ("CopyToDevice", "float32", (10, 100)),
                   ("Event.record",), ("Event.synchronize",)]
    with daemon.use(h):
        np.testing.assert_array_equal(bound[id(p)].array, values)
    assert ("SetData",) in log


def test_ascend_dispatch_without_hardware_writeback_and_free(ascend, make_param):
    daemon, log, bound = ascend
    p = make_param(np.ones(4096, np.float32), "w")
    h = daemon.register(p, tier="device")            # the only copy: dirty
    device_tensor = h._rec.block.tensor
    log.clear()
    daemon.evict(h).result(10)
    assert ("CopyToHost",) in log
    assert log.index(("CopyToHost",)) < log.index(("Free",))   # written back before freed
    assert ("hal.synchronize",) in log                           # compute fenced before reuse
    assert device_tensor.freed and h.tiers == ["remote"]
    daemon.prefetch(h).result(10)
    with daemon.use(h):
        np.testing.assert_array_equal(bound[id(p)].array, np.ones(4096, np.float32))


def test_ascend_dispatch_without_hardware_budget_is_enforced(ascend, make_param):
    daemon, log, bound = ascend
    handles = [daemon.register(make_param(np.full(256 * 1024, i, np.float32), f"t{i}"), tier="remote")
               for i in range(6)]                                  # 1 MiB each, 8 MiB budget
    for h in handles:
        daemon.prefetch(h).result(10)
    for h in handles:
        daemon.prefetch(h).result(10)
    status = daemon.status()
    assert status["device"]["peak"] <= status["device"]["high_watermark"]
    assert daemon.backend.device_used() <= daemon.config.high_watermark
    frees = log.count(("Free",))
    loads = log.count(("CopyToDevice", "float32", (256 * 1024,)))
    assert loads >= 6 and frees >= 0


def test_ascend_dispatch_without_hardware_failure_is_reported(ascend, make_param):
    daemon, log, bound = ascend
    p = make_param(np.arange(1024, dtype=np.float32), "w")
    h = daemon.register(p, tier="remote")

    def broken(*a, **k):
        raise RuntimeError("device copy failed (simulated)")
    working = daemon.backend.api.CopyToDevice
    daemon.backend.api.CopyToDevice = lambda: broken
    with pytest.raises(Exception, match="simulated"):
        daemon.prefetch(h).result(10)
    # not on the device; the remote copy (and a host replica staged on the way, if any) intact
    assert "device" not in h.tiers and "remote" in h.tiers
    daemon.backend.api.CopyToDevice = working
    daemon.prefetch(h).result(10)
    with daemon.use(h):
        np.testing.assert_array_equal(bound[id(p)].array, np.arange(1024, dtype=np.float32))


# ---------------------------------------------------------------- stable addresses over ACL VMM

GRAN = 2 << 20


class FakeAcl:
    """libascendcl's VMM calls, WITHOUT hardware: device memory is numpy arrays behind a fake
    address map. Calls get the real ctypes arguments AclVmm passes; each is logged and checked
    (granularity, mapped/unmapped state) the way the driver would refuse it."""

    def __init__(self, log):
        self.log = log
        self.next_va = 0x7E00_0000_0000
        self.reserved = {}         # va -> size
        self.physical = {}         # handle -> np.uint8 array
        self.mapped = {}           # va -> (size, handle)
        self.next_handle = 0x1000
        self.devices_set = []

    def _mapping(self, address, nbytes):
        for va, (size, handle) in self.mapped.items():
            if va <= address and address + nbytes <= va + size:
                return self.physical[handle], address - va
        return None, 0

    def aclrtReserveMemAddress(self, out, size, align, expect, flags):
        size = size.value
        assert size % GRAN == 0 and expect is None
        va, self.next_va = self.next_va, self.next_va + size + GRAN
        self.reserved[va] = size
        out._obj.value = va
        self.log.append(("aclrtReserveMemAddress", size))
        return 0

    def aclrtReleaseMemAddress(self, va):
        va = va.value
        assert not any(va <= m < va + self.reserved[va] for m in self.mapped), "release of a mapped range"
        del self.reserved[va]
        self.log.append(("aclrtReleaseMemAddress", va))
        return 0

    def aclrtMallocPhysical(self, out, size, prop, flags):
        p = prop._obj
        assert (p.memAttr, p.location.type, p.location.id) == (4, 1, 0)   # HBM huge pages, device 0
        size = size.value
        assert size % GRAN == 0
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.physical[handle] = np.zeros(size, np.uint8)
        out._obj.value = handle
        self.log.append(("aclrtMallocPhysical", size))
        return 0

    def aclrtFreePhysical(self, handle):
        assert handle.value not in [h for _, h in self.mapped.values()], "free of a mapped handle"
        del self.physical[handle.value]
        self.log.append(("aclrtFreePhysical", handle.value))
        return 0

    def aclrtMapMem(self, va, size, offset, handle, flags):
        va, size, handle = va.value, size.value, handle.value
        if va % GRAN or size % GRAN or size > self.physical[handle].size:
            return 107000                                     # ACL_ERROR_RT_PARAM_INVALID
        if not any(r <= va and va + size <= r + s for r, s in self.reserved.items()):
            return 107000
        if any(m < va + size and va < m + s for m, (s, _) in self.mapped.items()):
            return 107000
        self.mapped[va] = (size, handle)
        self.log.append(("aclrtMapMem", va, size, handle))
        return 0

    def aclrtUnmapMem(self, va):
        va = va.value
        if va not in self.mapped:
            return 107000
        del self.mapped[va]
        self.log.append(("aclrtUnmapMem", va))
        return 0

    def aclrtMemcpy(self, dst, dest_max, src, count, kind):
        count, kind = count.value, kind.value
        device = dst.value if kind == 1 else src.value
        memory, offset = self._mapping(device, count)
        if memory is None:
            return 507899                                     # the device faults on an unmapped address
        ptr = memory.ctypes.data + offset
        if kind == 1:
            ctypes.memmove(ptr, src.value, count)
        else:
            ctypes.memmove(dst.value, ptr, count)
        self.log.append(("aclrtMemcpy", kind, device, count))
        return 0

    def aclrtSetDevice(self, device_id):
        self.devices_set.append(device_id.value)
        return 0

    def read(self, address, shape, dtype):
        """What a device kernel reading `address` sees (None if it would fault)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        memory, offset = self._mapping(address, nbytes)
        return None if memory is None else memory[offset:offset + nbytes].view(dtype).reshape(shape)


class FakeDeviceView:
    """What MindSpore's from_dlpack gives on Ascend: a tensor reading device memory at an address."""

    def __init__(self, capsule, acl):
        self.address, self.shape, self.dtype, self.device_type, self.device_id = read_capsule(capsule)
        self.acl = acl
        self.freed = False

    def values(self):
        return self.acl.read(self.address, self.shape, self.dtype)


@pytest.fixture
def vmm_backend(store_dir):
    import dataclasses
    log = []
    acl = FakeAcl(log)
    api, bound = fake_api(log)
    api = dataclasses.replace(api, from_dlpack=lambda capsule: FakeDeviceView(capsule, acl))
    config = Config.load(env={}, backend="ascend", device_budget="16MiB", store_dir=store_dir)
    backend = AscendVmmBackend(config, api=api, vmm=AclVmm(lib=acl))
    yield backend, acl, log, bound
    backend.close()


def completions(backend, *tags):
    done = {}
    while len(done) < len(tags):
        got = backend.wait_completions(10)
        assert got or len(done) < len(tags), "no completion within 10 s"
        done.update((c.tag, c) for c in got)
    return done


def wait_tags(backend, *tags):
    done = completions(backend, *tags)
    assert all(done[t].status == 0 for t in tags), [(c.tag, c.message) for c in done.values()]


def test_ascend_vmm_without_hardware_attach_detach_map_order_and_bind_once(vmm_backend):
    backend, acl, log, bound = vmm_backend
    shape, dtype = (512, 1024), np.float32          # exactly 2 MiB
    nbytes = 512 * 1024 * 4
    vrange = backend.reserve(3 * GRAN)
    home = backend.home(vrange, GRAN, nbytes)
    assert home.address == vrange.address + GRAN and home.capacity == GRAN
    olds, news = np.full(shape, 1.5, dtype), np.arange(512 * 1024, dtype=dtype).reshape(shape)
    backend.write_sync("old", olds)
    backend.write_sync("new", news)
    log.clear()
    a, b = backend.alloc_device(nbytes), backend.alloc_device(nbytes)
    assert log[:3] == [("aclrtMallocPhysical", GRAN), ("aclrtReserveMemAddress", GRAN),
                       ("aclrtMapMem", a.scratch, GRAN, a.handle)]
    assert backend.device_used() == 2 * GRAN
    backend.start_load("old", a, nbytes, 1, True, shape, dtype)
    backend.start_load("new", b, nbytes, 2, True, shape, dtype)
    wait_tags(backend, 1, 2)
    assert ("aclrtMemcpy", 1, a.scratch, nbytes) in log and acl.devices_set == [0]
    log.clear()
    backend.attach(home, a)
    assert log == [("aclrtUnmapMem", a.scratch), ("aclrtMapMem", home.address, GRAN, a.handle)]
    target = object()
    backend.bind(target, home, shape, dtype)                       # once
    view = bound[id(target)]
    assert (view.address, view.shape, view.dtype, view.device_type) == (home.address, shape, np.dtype(dtype), 12)
    np.testing.assert_array_equal(view.values(), olds)
    log.clear()
    backend.detach(home, a)
    assert log == [("aclrtUnmapMem", home.address), ("aclrtMapMem", a.scratch, GRAN, a.handle)]
    assert view.values() is None                                   # a detached home faults
    backend.attach(home, b)
    np.testing.assert_array_equal(view.values(), news)             # same tensor, new weights
    backend.detach(home, b)
    log.clear()
    backend.free_device(a)
    assert log == [("aclrtUnmapMem", a.scratch), ("aclrtReleaseMemAddress", a.scratch),
                   ("aclrtFreePhysical", a.handle)]
    backend.free_device(b)
    vrange.close()
    assert backend.device_used() == 0 and not acl.mapped and not acl.physical and not acl.reserved


def test_ascend_vmm_without_hardware_store_and_copies_read_the_home(vmm_backend):
    backend, acl, log, bound = vmm_backend
    nbytes = 3 * 4096
    vrange = backend.reserve(GRAN)
    home = backend.home(vrange, 0, nbytes)
    block = backend.alloc_device(nbytes)
    data = np.random.default_rng(0).integers(0, 256, nbytes, np.uint8)
    backend.start_copy(TransferKind.H2D, block, data, nbytes, 1)
    wait_tags(backend, 1)
    backend.attach(home, block)
    backend.start_store("k", home, nbytes, b"meta", 2)
    out = np.zeros(nbytes, np.uint8)
    backend.start_copy(TransferKind.D2H, out, home, nbytes, 3)
    wait_tags(backend, 2, 3)
    np.testing.assert_array_equal(out, data)
    back = np.zeros(nbytes, np.uint8)
    backend.read_sync("k", back)
    np.testing.assert_array_equal(back, data)
    assert ("aclrtMemcpy", 2, home.address, nbytes) in log
    backend.detach(home, block)
    backend.start_copy(TransferKind.D2H, out, home, nbytes, 4)    # a detached home is not readable
    failed = completions(backend, 4)[4]
    assert failed.status != 0 and "aclrtMemcpy failed with ACL error 507899" in failed.message
    backend.free_device(block)


def test_ascend_vmm_without_hardware_errors(vmm_backend):
    backend, acl, log, bound = vmm_backend
    vrange = backend.reserve(4 * GRAN)
    with pytest.raises(ValueError, match="not a multiple of the Ascend mapping granularity"):
        backend.home(vrange, 4096, 10)
    with pytest.raises(ValueError, match="does not fit"):
        backend.home(vrange, 3 * GRAN, GRAN + 1)
    home = backend.home(vrange, 0, GRAN + 1)                     # two granules
    with pytest.raises(ValueError, match="overlaps the home at offset 0"):
        backend.home(vrange, GRAN, 10)
    small = backend.alloc_device(GRAN)
    with pytest.raises(ValueError, match="cannot back a home"):
        backend.attach(home, small)
    block = backend.alloc_device(GRAN + 1)
    backend.attach(home, block)
    with pytest.raises(ValueError, match="already has a block attached"):
        backend.attach(home, backend.alloc_device(2 * GRAN))
    with pytest.raises(ValueError, match="does not hold this block"):
        backend.detach(home, small)
    with pytest.raises(_native.NativeError, match="attached to a home"):
        backend.free_device(block)
    with pytest.raises(_native.NativeError, match="attached homes"):
        vrange.close()
    with pytest.raises(_native.OutOfSpace, match="device budget"):
        backend.alloc_device(16 << 20)
    backend.detach(home, block)
    backend.free_device(block)
    with pytest.raises(_native.Closed):
        backend.free_device(block)
    # a driver refusal names the call and its code, and leaves the block mapped where it was
    other = backend.alloc_device(GRAN + 1)
    real_map = acl.aclrtMapMem
    acl.aclrtMapMem = lambda va, *rest: 107000 if va.value == home.address else real_map(va, *rest)
    with pytest.raises(_native.NativeError, match="aclrtMapMem failed with ACL error 107000"):
        backend.attach(home, other)
    acl.aclrtMapMem = real_map
    assert other.home is None and home.block is None
    assert acl.mapped[other.scratch] == (2 * GRAN, other.handle)     # mapped back at its scratch


def test_ascend_vmm_without_hardware_missing_runtime_is_a_clear_error():
    vmm = AclVmm(lib_name="libascendcl-not-installed.so")
    with pytest.raises(_native.NativeError, match="cannot load libascendcl-not-installed.so"):
        vmm.reserve(GRAN)


def test_ascend_vmm_without_hardware_daemon_binds_once_and_maps_under_the_home(store_dir, make_param):
    import dataclasses
    log = []
    acl = FakeAcl(log)
    api, bound = fake_api(log)
    api = dataclasses.replace(api, from_dlpack=lambda capsule: FakeDeviceView(capsule, acl))
    config = Config.load(env={}, backend="ascend", device_budget="8MiB", store_dir=store_dir)
    daemon = Daemon(config, backend=AscendVmmBackend(config, api=api, vmm=AclVmm(lib=acl))).start()
    try:
        values = [np.full(256 * 1024, i, np.float32) for i in range(6)]     # 1 MiB each: 2 MiB granules
        params = [make_param(v, f"t{i}") for i, v in enumerate(values)]
        handles = [daemon.register(p, tier="remote") for p in params]
        views = {id(p): bound[id(p)] for p in params}
        assert log.count(("SetData",)) == len(params)                    # bound once, at registration
        for _ in range(2):                                                # more than fits: evictions
            for p, h, v in zip(params, handles, values):
                daemon.prefetch(h).result(10)
                with daemon.use(h):
                    np.testing.assert_array_equal(views[id(p)].values(), v)
        assert log.count(("SetData",)) == len(params)                    # never rebound
        assert {id(p): bound[id(p)] for p in params} == views
        assert daemon.backend.device_used() <= daemon.config.high_watermark
    finally:
        daemon.close()
