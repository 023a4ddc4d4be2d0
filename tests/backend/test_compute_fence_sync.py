"""The whole-queue compute fence (framework.synchronize) waits for the compute dispatched
before it, from the first call in a process on. MindSpore 2.10's runtime.synchronize, the
replacement of the deprecated hal.synchronize, logs "CPU device is not supported" and
returns without waiting the first time it is called on CPU: a fence that does not fence
lets a block be reused while a kernel still reads it."""
import subprocess
import sys

from helpers import ENV

CHILD = r"""
import numpy as np, mindspore as ms
ms.set_device("CPU")
from prefetchd.backend import framework
marker = framework.ComputeMarker()          # its own probe waited for its own fence
a = ms.Tensor(np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32))
for _ in range(3):
    y = a
    for _ in range(12):
        y = ms.ops.matmul(y, a) * 1e-3      # ~0.1-0.3 s of queued compute
    epoch = marker.mark(y)
    framework.synchronize()
    print("reached" if marker.reached(epoch) else "NOT reached", flush=True)
"""


def test_the_first_whole_queue_fence_of_a_process_waits_for_compute():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=ENV, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["reached"] * 3, out.stdout + out.stderr[-2000:]
    assert "CPU device is not supported" not in out.stderr
