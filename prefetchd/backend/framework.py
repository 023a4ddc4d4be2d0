"""The few MindSpore calls prefetchd makes, in one place (see MINDSPORE-NOTES.md).

- `Tensor.from_numpy` is zero-copy, so a framework tensor can view an arena block.
- `Parameter.set_data(t, slice_shape=True)` rebinds storage; it blocks until
  MindSpore's op queue drains if the old storage was used by an op, so callers
  bind on the compute thread, never on the scheduler.
- `hal.synchronize()` is the only fence that works on CPU; it drains every queue.
"""
import numpy as np

from ..guard import base_class

_ms = None


def mindspore():
    global _ms
    if _ms is None:
        import mindspore as ms
        _ms = ms
    return _ms


def is_parameter(x):
    return isinstance(x, mindspore().Parameter)


def is_tensor(x):
    return isinstance(x, mindspore().Tensor)


def to_numpy_dtype(ms_dtype):
    ms = mindspore()
    try:
        return np.dtype(ms.dtype_to_nptype(ms_dtype))
    except Exception:
        raise TypeError(f"dtype {ms_dtype} has no numpy equivalent; prefetchd cannot manage it") from None


def host_copy(x):
    """A numpy copy of x's values (waits for pending compute that writes x)."""
    return x.asnumpy()


def bind(target, array):
    """Make `target` view `array`'s memory from now on (no copy).

    Calls the framework's own method (not a prefetchd tracking override), so
    rebinding is not mistaken for a user's write.
    """
    ms = mindspore()
    tensor = ms.Tensor.from_numpy(array)
    cls = base_class(target)
    if isinstance(target, ms.Parameter):
        cls.set_data(target, tensor, slice_shape=True)
    else:
        cls.assign_value(target, tensor)


def bind_placeholder(target, dtype):
    """Point `target` at a 0-element tensor: later ops on it fail with a shape error."""
    bind(target, np.zeros((0,), dtype=dtype))


def synchronize():
    mindspore().hal.synchronize()
