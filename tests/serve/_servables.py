"""Servables the serving tests run in real worker processes (--model tests' module:function)."""
import time

import numpy as np

from prefetchd.serve import TensorSpec

MAX_SLEEP = 30.0


class Sleepy:
    """forward(x) sleeps x[0, 0] seconds (at most MAX_SLEEP), then runs a Dense layer:
    a request that is as slow as it asks to be, for timeouts, deaths and hangs."""

    def __init__(self, seed):
        import mindspore as ms
        from mindspore import nn
        self.cell = nn.Dense(4, 4)
        rng = np.random.default_rng(seed)
        for p in self.cell.get_parameters():
            p.set_data(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32)))
        self.inputs = [TensorSpec((None, 4), "float32", 0, "x")]

    def forward(self, x):
        import mindspore as ms
        if x.size and x[0, 0] > 0:
            time.sleep(min(float(x[0, 0]), MAX_SLEEP))
        return self.cell(ms.Tensor(x))


def sleepy(seed=0):
    return Sleepy(seed)
