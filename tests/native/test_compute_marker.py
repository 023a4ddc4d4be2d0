"""Compute markers: what a fence's epoch promises, and markers used from several threads at
once (a server's request threads, two models).

MindSpore 2.10 breaks its op queue for good when two threads dispatch ops at
the same moment (docs/mindspore-notes.md), so the threads check runs in a child process.
"""
import json
import os
import subprocess
import sys

import numpy as np

from helpers import ENV

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/, where the child scripts are


def test_markers_and_first_uses_from_several_threads_at_once_leave_mindspore_working(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(HERE, "_marker_threads.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["markers"] == ["ok"] * 12, got["markers"]
    assert got["uses"] == ["ok"] * 3, got["uses"]
    assert got["one_marker"], "threads that raced to the first use built separate markers"
    assert got["synchronize"] == "ok", got["synchronize"]


def test_a_fence_is_reached_only_after_the_compute_queued_before_it(ms):
    """The kernel counts its runs: epochs come out 1, 2, ... per marker, and the word reaches
    a fence's epoch only once MindSpore executed the ops queued before it (here 40 matmuls of
    1024x1024, so a fence run early would be seen at once)."""
    from prefetchd.backend.framework import ComputeMarker
    first, second = ComputeMarker(), ComputeMarker()     # each proved itself with epoch 1
    x = ms.Tensor(np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32))
    quick = first.mark(x)
    assert quick == 2 and second.mark(x) == 2           # numbered per marker
    assert first.wait(quick, 30.0) >= quick
    y = x
    for _ in range(40):
        y = ms.ops.matmul(y, x) * 1e-3
    slow = first.mark(y)
    assert slow == 3
    assert not first.reached(slow), "the fence ran before the matmuls queued ahead of it"
    assert first.wait(slow, 60.0) == slow
    assert np.isfinite(y.asnumpy()).all()
    assert int(first.word[0]) == slow and int(second.word[0]) == 2   # one count per fence run


def test_a_watched_fence_wakes_the_completion_queue_once_and_only_when_it_runs(ms):
    """The scheduler sleeps on its completion queue alone: a marker counting in the queue's
    fence block rings the queue when the fence it watches runs (not before, not by the
    timeout), a fence already run wakes it at once, and a wake fires once."""
    import threading
    import time

    from prefetchd import _native
    from prefetchd.backend.framework import ComputeMarker
    cq = _native.CompletionQueue()
    marker = ComputeMarker(cq.fence_block)                 # proved itself: count 1
    assert cq.wait(0.05) == []                             # nothing watched: the timeout
    t0 = time.monotonic()
    assert cq.watch_fence(1) and cq.wait(5.0) == []        # already reached: returns at once
    assert time.monotonic() - t0 < 2.0, "a fence already run did not wake the queue"
    t0 = time.monotonic()
    assert cq.wait(0.2) == [] and time.monotonic() - t0 >= 0.15, "the reached fence woke the queue twice"

    x = ms.Tensor(np.random.default_rng(0).standard_normal((1024, 1024), dtype=np.float32))
    y = x
    for _ in range(40):
        y = ms.ops.matmul(y, x) * 1e-3
    epoch = marker.mark(y)
    assert cq.watch_fence(epoch) and not cq.watch_fence(epoch)   # a new target once
    woke = []
    waiter = threading.Thread(target=lambda: woke.append((cq.wait(30.0), marker.reached(epoch),
                                                          time.monotonic())))
    t0 = time.monotonic()
    waiter.start()
    waiter.join(60.0)
    assert woke, "the queue's wait never returned"
    completions, reached, at = woke[0]
    assert completions == [] and reached, "the queue woke before the watched fence ran"
    assert at - t0 < 25.0, "woken by the timeout, not by the fence"
    assert np.isfinite(y.asnumpy()).all()


def test_a_completion_queue_with_no_fence_watched_wakes_for_notify_and_pushes():
    import threading
    import time

    from prefetchd import _native
    cq = _native.CompletionQueue()
    threading.Timer(0.1, cq.notify).start()
    t0 = time.monotonic()
    assert cq.wait(10.0) == [] and 0.05 < time.monotonic() - t0 < 5.0
    stream = _native.Stream("t")
    try:
        src, dst = _native.aligned_buffer(4096), _native.aligned_buffer(4096)
        stream.copy(dst, src, 4096, tag=7, cq=cq)
        deadline = time.monotonic() + 30.0
        got = cq.wait(10.0)
        while not got and time.monotonic() < deadline:   # a spurious empty wake: wait again, bounded
            got = cq.wait(10.0)
        assert [c.tag for c in got] == [7] and got[0].status == 0
    finally:
        stream.close()
