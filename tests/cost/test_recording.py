"""The recording pass's timer: each unit timed alone, the root's compute from the pass,
repeated units pooled. A fake compute thread stands in for MindSpore's queue."""
import queue
import threading
import time

import pytest

from helpers import FakeMarker
from prefetchd.cost import recording

MiB = 1 << 20


class FakeCompute(FakeMarker):
    """A fence word raised by one 'compute' thread that runs queued jobs in order."""

    def __init__(self):
        super().__init__()
        self.queue, self.queued = queue.SimpleQueue(), 0
        threading.Thread(target=self._work, daemon=True).start()

    def run(self, seconds):
        """Queue `seconds` of compute; returns the epoch its fence will reach."""
        self.queued += 1
        self.queue.put((self.queued, seconds))
        return self.queued

    def _work(self):
        while True:
            epoch, seconds = self.queue.get()
            time.sleep(seconds)
            self.reach(epoch)


def common():
    return dict(high_watermark=1024 * MiB, host_budget=1024 * MiB, disk_rate=1e9, h2d_rate=4e9)


def test_units_are_timed_alone_and_the_root_gets_the_rest_of_the_pass():
    compute = FakeCompute()
    timer = recording.RecordingTimer(compute)
    stall = 5.0                              # seconds stalled before this pass
    timer.pass_started(stall)
    time.sleep(0.08)                         # root compute before the first unit (an embedding)
    for name in ("a", "b", "c"):
        time.sleep(0.05)                     # the unit's weights load: a stall
        stall += 0.05
        dispatched = time.monotonic_ns()
        epoch = compute.run(0.1)
        timer.released(name, epoch, dispatched)
        assert compute.word >= epoch, "released() returned before the unit's compute finished"
    timer.released("root", compute.run(0.04))     # the head, behind the output's fence
    inputs = timer.inputs([MiB] * 3, ["block"] * 3, stall, **common())
    assert inputs.compute_seconds == pytest.approx((0.1, 0.1, 0.1), abs=0.03)
    assert inputs.root_seconds == pytest.approx(0.08 + 0.04, abs=0.04)


def test_a_unit_slower_than_the_wait_ends_the_waiting_and_the_root_estimate(monkeypatch):
    monkeypatch.setattr(recording, "FENCE_WAIT_S", 0.05)
    compute = FakeCompute()
    timer = recording.RecordingTimer(compute)
    timer.pass_started(0.0)
    t = time.monotonic()
    timer.released("slow", compute.run(0.5), time.monotonic_ns())
    assert 0.04 < time.monotonic() - t < 0.4
    t = time.monotonic()
    timer.released("next", compute.run(0.05), time.monotonic_ns())   # no wait any more
    timer.released("root", compute.run(0.01))
    assert time.monotonic() - t < 0.04
    inputs = timer.inputs([MiB] * 2, ["a", "b"], 0.0, **common())
    assert inputs.root_seconds == 0.0
    assert sum(inputs.compute_seconds) == pytest.approx(0.55, abs=0.1)


def test_unit_kind_is_cell_types_and_parameter_shapes():
    class Dense:
        pass

    class P:
        def __init__(self, shape, dtype="Float32"):
            self.shape, self.dtype = shape, dtype
    same = recording.unit_kind([Dense()], [P((4, 4)), P((4,))])
    assert same == recording.unit_kind([Dense()], [P((4, 4)), P((4,))])
    assert same != recording.unit_kind([Dense()], [P((4, 8)), P((4,))])
    assert same != recording.unit_kind([Dense()], [P((4, 4)), P((4,), "Float16")])
