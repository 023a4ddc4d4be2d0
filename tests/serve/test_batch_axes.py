"""Batched requests are split back along the axis the model's rows are on: the inputs' batch
axis unless the servable says otherwise (prefetchd/serve/servable.py). One worker's batch is
run here in-process (execute.run_batch), with a real MindSpore cell."""
import numpy as np
import pytest

from prefetchd.config import ConfigError
from prefetchd.serve import TensorSpec
from prefetchd.serve.execute import run_batch
from prefetchd.serve.servable import ServedModel, as_servable
from prefetchd.serve.wire import decode_arrays, encode_arrays


def _batch(servable, requests):
    """Each request's outputs from one joined batch, as a worker computes them."""
    parts, frames = [], []
    for arrays in requests:
        headers, buffers = encode_arrays(arrays)
        parts.append({"inputs": headers})
        frames.extend(buffers)
    model = ServedModel("m0", servable, handle=None, hints=[])
    result, out = run_batch(model, {"model": "m0", "kind": "infer", "parts": parts}, frames, 1 << 30)
    answers, at = [], 0
    for headers in result["outputs"]:
        answers.append([np.array(a) for a in decode_arrays(headers, out[at:at + len(headers)], what="output")])
        at += len(headers)
    return answers


def _time_major(ms):
    """A cell over (time, batch, features) inputs: the rows are on axis 1."""
    class TimeMajor(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = ms.nn.Dense(16, 8)

        def construct(self, x):
            return self.dense(x) * 2
    return TimeMajor()


def test_rows_on_axis_1_come_back_to_their_own_request(mindspore_cpu):
    ms = mindspore_cpu
    cell = _time_major(ms)
    servable = as_servable((cell, [TensorSpec((4, None, 16), "float32", batch_axis=1, name="x")]), "t:f")
    rng = np.random.default_rng(0)
    # Two 2-row requests join into (4, 4, 16): axis 0 is also 4 long, so splitting the wrong
    # axis gave each request (2, 4, 8) of mixed rows, with no error.
    requests = [[rng.standard_normal((4, 2, 16)).astype(np.float32)] for _ in range(2)]
    for (x,), (answer,) in zip(requests, _batch(servable, requests)):
        assert answer.shape == (4, 2, 8)
        np.testing.assert_allclose(answer, cell(ms.Tensor(x)).asnumpy(), rtol=1e-6, atol=1e-6)


def test_inputs_batching_along_different_axes_need_the_servable_to_say(mindspore_cpu):
    ms = mindspore_cpu
    specs = [TensorSpec((None, 16), "float32", 0, "a"), TensorSpec((16, None), "float32", 1, "b")]
    with pytest.raises(ConfigError, match=r"batch along axes \[0, 1\].*output_batch_axis"):
        as_servable((_time_major(ms), specs), "t:f")
