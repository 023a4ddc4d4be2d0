"""Ctrl-C in a process running prefetchd is Python's KeyboardInterrupt. MindSpore's runtime
installs a native SIGINT handler at its first op that ends the process with SIGTERM (exit
143): no `finally`, no Daemon.close(), and a weight written but not yet written back was
lost (an outside probe; prefetchd.sigint). A real SIGINT, in a real child process."""
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import ENV

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sigint_child.py")


@pytest.mark.parametrize("when", ["after_offload", "after_forward", "ignored"])
def test_ctrl_c_raises_keyboard_interrupt_and_the_daemon_closes_and_writes_back(tmp_path, when):
    """(A SIGINT the program set to SIG_IGN stays ignored: MindSpore's handler replaced that too.)"""
    store = tmp_path / "store"
    proc = subprocess.run([sys.executable, CHILD, str(store), when], env=ENV, capture_output=True,
                          text=True, timeout=120)
    expected = "not interrupted" if when == "ignored" else "interrupted"
    assert proc.returncode == 0 and proc.stdout.strip() == expected, (proc.returncode, proc.stderr[-2000:])
    import mindspore as ms
    import prefetchd
    model = ms.nn.SequentialCell([ms.nn.Dense(64, 64) for _ in range(4)])
    with prefetchd.Daemon(device_budget="64KiB", store_dir=str(store)) as daemon:
        prefetchd.offload(model, daemon, lookahead=1, checkpoint=True)    # the weights the child left
        with daemon.use([model[0].weight]):
            assert np.all(model[0].weight.asnumpy() == 7)
