"""A real SIGINT (os.kill, as a terminal's Ctrl-C sends it) into a process that ran MindSpore
ops, then offloaded a model and wrote one of its weights (a child of
tests/hooks/test_interrupts.py).

argv: store_dir, when ("after_offload": before any offloaded forward; "after_forward";
"ignored": SIGINT set to SIG_IGN before MindSpore's first op). Prints "interrupted" once
the KeyboardInterrupt is caught ("not interrupted" when ignored), and exits 0 through
the Daemon's `with` (its close writes the weight back). MindSpore's own handler ended
the process with SIGTERM (exit 143) instead.
"""
import os
import signal
import sys
import time

import mindspore as ms
import numpy as np

import prefetchd

store_dir, when = sys.argv[1], sys.argv[2]
ms.set_device("CPU")
nn = ms.nn
ms.set_seed(0)
model = nn.SequentialCell([nn.Dense(64, 64) for _ in range(4)])
x = ms.Tensor(np.ones((2, 64), np.float32))
if when == "ignored":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
model(x)                                     # MindSpore's first ops: its SIGINT handler
with prefetchd.Daemon(device_budget="64KiB", store_dir=store_dir) as daemon:
    prefetchd.offload(model, daemon, lookahead=1)
    if when == "after_forward":
        model(x)
    with daemon.use([model[0].weight]):
        model[0].weight.set_data(ms.Tensor(np.full((64, 64), 7, np.float32)))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1 if when == "ignored" else 5)
        print("not interrupted", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
