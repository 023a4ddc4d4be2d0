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
