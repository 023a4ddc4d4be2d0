"""Stream a real model through a real daemon and compare every pass with the resident model
(import as `from _stream_check import ...`; tests/hooks and the mindone/mindcv tests use it)."""
import numpy as np

import prefetchd
from prefetchd.hooks.planner import param_nbytes


def weight_bytes(model):
    return sum(param_nbytes(p) for p in {id(p): p for p in model.get_parameters()}.values())


def first_array(output):
    """The first tensor of a model's output (a tensor, a tuple, an HF-style output object)."""
    if hasattr(output, "asnumpy"):
        return output.asnumpy()
    if isinstance(output, (tuple, list)):
        return first_array(output[0])
    if hasattr(output, "to_tuple"):
        return first_array(output.to_tuple())
    if isinstance(output, dict):
        return first_array(next(iter(output.values())))
    raise TypeError(f"no tensor in {type(output).__name__}")


def stream_and_compare(model, inputs, store_dir, *, fraction, lookahead=2, passes=3, call=None, **options):
    """Offload `model` at `fraction` of its weights (README usage) and run `passes` passes,
    each over every input in `inputs` (a list of argument tuples; several: shapes that change
    between passes). Every output must equal the resident model's, bit for bit, and the device
    peak stay under the high watermark; in steady state nothing misses. Returns (plan, stats)."""
    call = call or (lambda m, args: m(*args))
    model.set_train(False)
    want = [first_array(call(model, args)) for args in inputs]
    budget = int(weight_bytes(model) * fraction)
    with prefetchd.Daemon(device_budget=budget, store_dir=store_dir) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=lookahead, **options)
        for i in range(passes):
            for args, expected in zip(inputs, want):
                np.testing.assert_array_equal(first_array(call(model, args)), expected, err_msg=f"pass {i}")
        status = daemon.status()["device"]
        assert 0 < status["peak"] <= status["high_watermark"], status
        stats = handle.stats()
        assert stats["misses"] == 0, stats
        plan = handle.plan()
        handle.close()
        return plan, stats


def root_share(plan):
    """The root's share of the model's parameter bytes."""
    return sum(param_nbytes(p) for p in plan.root.params) / plan.total_bytes
