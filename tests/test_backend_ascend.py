"""The Ascend backend's dispatch, run WITHOUT Ascend hardware.

This machine has no NPU, so MindSpore's Ascend-only entry points
(CopyToDevice/CopyToHost/Free/SetData and hal.Stream/Event) are replaced by
fakes that record each call and keep device tensors as numpy copies. What is
real: the daemon, the native file store, the copy thread, the data path.
"""
import numpy as np
import pytest

from prefetchd import Config, Daemon
from prefetchd.backend.ascend import AscendApi, AscendBackend


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
    h = daemon.register(make_param(np.ones(1024, np.float32), "w"), tier="remote")

    def broken(*a, **k):
        raise RuntimeError("device copy failed (simulated)")
    daemon.backend.api.CopyToDevice = lambda: broken
    with pytest.raises(Exception, match="simulated"):
        daemon.prefetch(h).result(10)
    assert h.tiers == ["remote"]
