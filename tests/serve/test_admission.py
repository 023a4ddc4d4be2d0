"""What the front refuses before it queues a request (prefetchd/serve/admission.py):
a refusal here is the request's own, never its batch-mates'."""
import numpy as np
import pytest

from prefetchd.control.codes import BadArguments
from prefetchd.serve import TensorSpec
from prefetchd.serve.admission import ModelInfo, admit
from prefetchd.serve.wire import encode_arrays

MASKED = ModelInfo((TensorSpec((None, 4), "float32", name="x"), TensorSpec((None, 4), "bool", name="mask")),
                   generates=False)


def _admit(arrays):
    headers, frames = encode_arrays(arrays)
    return admit(MASKED, "infer", headers, [bytes(f) for f in frames], 1 << 20)


def test_a_bool_input_holding_other_bytes_is_refused_at_admission():
    """It was queued (only a bounded input's values were read there) and the worker's decode
    refused it for the whole joined batch: every batch-mate got its BAD_REQUEST."""
    x = np.ones((2, 4), np.float32)
    good = np.array([[1, 0, 1, 0], [0, 0, 1, 1]], np.uint8)
    assert _admit([x, good.view(np.bool_)])[0] == 2
    bad = good.copy()
    bad[1, 2] = 2
    with pytest.raises(BadArguments, match="input 1: bool tensor holds bytes other than 0 and 1"):
        _admit([x, bad.view(np.bool_)])


def test_an_empty_free_axis_is_refused_at_admission_like_an_empty_batch():
    """(2, 0) ids passed the front and reached the model, whose failure came back INTERNAL
    with MindSpore's C++ call stack (an outside probe)."""
    ids = ModelInfo((TensorSpec((None, None), "int64", name="ids"),), generates=False)
    headers, frames = encode_arrays([np.zeros((2, 0), np.int64)])
    with pytest.raises(BadArguments, match=r"input 0 \(ids\): dimension 1 is 0 \(an empty input\)"):
        admit(ids, "infer", headers, [bytes(f) for f in frames], 1 << 20)
    headers, frames = encode_arrays([np.zeros((2, 3), np.int64)])
    assert admit(ids, "infer", headers, [bytes(f) for f in frames], 1 << 20)[0] == 2
