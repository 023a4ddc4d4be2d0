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


def test_a_big_endian_array_is_sent_as_its_values():
    # `prefetchd infer` of a big-endian .npy (numpy.save keeps the byte order) was
    # "ValueError: dtype >f4 is not carried on the wire" (an outside probe).
    value = np.arange(6, dtype=">f4").reshape(2, 3)
    headers, buffers = encode_arrays([value])
    assert headers == [{"dtype": "float32", "shape": [2, 3]}]
    (back,) = decode_arrays(headers, [bytes(b) for b in buffers])
    assert back.dtype == np.dtype("<f4") and np.array_equal(back, value)


@pytest.mark.parametrize("shape", [[0, 2 ** 62], [2 ** 62, 0, 2 ** 62]])
def test_an_empty_shape_too_large_for_numpy_is_a_bad_request(shape):
    """No bytes, so within every size limit, yet numpy cannot make the array: a ValueError
    from numpy was answered INTERNAL, as a server defect."""
    from prefetchd.control.codes import BadArguments
    with pytest.raises(BadArguments, match="too large for an array"):
        decode_arrays([{"dtype": "float32", "shape": shape}], [b""])
