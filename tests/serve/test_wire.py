"""The serve wire carries a tensor's shape as it is: a 0-d input or output stays 0-d (it
came back as shape [1]), a bool stays bool, an empty tensor stays empty."""
import numpy as np
import pytest

from prefetchd.serve.wire import decode_arrays, encode_arrays


@pytest.mark.parametrize("value", [np.array(2.5, np.float32), np.array(True), np.zeros((0, 3), np.int64)])
def test_the_wire_keeps_a_tensors_shape(value):
    headers, buffers = encode_arrays([value])
    assert headers == [{"dtype": value.dtype.name, "shape": list(value.shape)}]
    (back,) = decode_arrays(headers, [bytes(b) for b in buffers])
    assert back.shape == value.shape and np.array_equal(back, value)
