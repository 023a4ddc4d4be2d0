"""Tensors on the wire: an `infer` request or reply carries its tensors as raw
frames after the JSON header, one frame per tensor, described in the header by
`[{"dtype": "float32", "shape": [4, 16, 256]}, ...]` in frame order.

Receivers take the frames without a copy (zmq `copy=False`) and view them with
np.frombuffer. Every header is checked before any byte is used: a list of at
most MAX_TENSORS objects with exactly `dtype` and `shape`, a dtype from DTYPES,
a shape of at most MAX_RANK integers in [0, MAX_DIM], a size within `max_bytes`
(computed with Python integers: a huge shape cannot overflow), as many frames
as headers, and each frame exactly as long as its header says. A bool tensor
holds only 0 and 1. Anything else is a BadArguments naming the tensor, which
the front answers BAD_REQUEST. No pickle: a frame is only ever read as numbers.
"""
import numpy as np

from ..control.codes import BadArguments

DTYPES = {name: np.dtype(name) for name in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64")}
MAX_TENSORS = 64
MAX_RANK = 8
MAX_DIM = 1 << 62        # past every byte limit; a longer integer cannot even be printed
DEFAULT_MAX_TENSOR_BYTES = 256 << 20


def frame_length(frame):
    """Bytes of a received frame (a zmq.Frame with copy=False, else bytes)."""
    return len(frame.buffer) if hasattr(frame, "buffer") else len(frame)


def encode_arrays(arrays):
    """(headers, buffers) of numpy arrays: C-contiguous buffers, one per array, that can
    be sent with copy=False. ValueError for a dtype the wire does not carry."""
    headers, buffers = [], []
    for i, a in enumerate(arrays):
        a = np.require(a, requirements="C")     # (np.ascontiguousarray makes a 0-d array 1-d)
        if a.dtype.byteorder == ">":            # the wire is little-endian: the same values, swapped
            a = a.astype(a.dtype.newbyteorder("<"))
        if a.dtype.name not in DTYPES:
            raise ValueError(f"tensor {i}: dtype {a.dtype} is not carried on the wire; "
                             f"use one of {', '.join(DTYPES)}")
        headers.append({"dtype": a.dtype.name, "shape": list(a.shape)})
        buffers.append(a.reshape(-1).view(np.uint8) if a.size else b"")
    return headers, buffers


def check_headers(headers, what="input"):
    """[(np.dtype, shape tuple)] of a header list; BadArguments naming the tensor."""
    if not isinstance(headers, list):
        raise BadArguments(f"'{what}s' must be a list of {{dtype, shape}} objects")
    if len(headers) > MAX_TENSORS:
        raise BadArguments(f"{len(headers)} {what}s: at most {MAX_TENSORS}")
    out = []
    for i, h in enumerate(headers):
        name = f"{what} {i}"
        if not isinstance(h, dict) or set(h) != {"dtype", "shape"}:
            raise BadArguments(f"{name}: header must be an object with exactly 'dtype' and 'shape'")
        dtype, shape = h["dtype"], h["shape"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise BadArguments(f"{name}: dtype {str(dtype)[:32]!r} is not one of {', '.join(DTYPES)}")
        if (not isinstance(shape, list) or len(shape) > MAX_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM
                           for d in shape)):
            raise BadArguments(f"{name}: shape must be a list of at most {MAX_RANK} "
                               f"non-negative integers, each at most 2**62")
        out.append((DTYPES[dtype], tuple(shape)))
    return out


def nbytes(dtype, shape):
    n = dtype.itemsize
    for d in shape:
        n *= d                 # Python ints: exact for any shape
    return n


def check_sizes(described, frames, max_bytes, what="input"):
    """Frames against their checked headers: count, size limit, exact length."""
    if len(frames) != len(described):
        missing = len(frames) < len(described)
        raise BadArguments(f"{len(described)} {what} headers but {len(frames)} tensor frames "
                           f"({'missing' if missing else 'extra'} frames)")
    total = 0
    for i, ((dtype, shape), frame) in enumerate(zip(described, frames)):
        size = nbytes(dtype, shape)
        if size > max_bytes:
            raise BadArguments(f"{what} {i}: shape {list(shape)} of {dtype.name} is {size} bytes, "
                               f"over the limit of {max_bytes}")
        total += size
        if frame_length(frame) != size:
            raise BadArguments(f"{what} {i}: shape {list(shape)} of {dtype.name} needs {size} "
                               f"bytes, its frame has {frame_length(frame)}")
    if total > max_bytes:
        raise BadArguments(f"{what}s: {total} bytes in all, over the limit of {max_bytes}")


def view_arrays(described, frames, what="input"):
    """Read-only numpy views of checked frames (no copy)."""
    arrays = []
    for i, ((dtype, shape), frame) in enumerate(zip(described, frames)):
        buf = frame.buffer if hasattr(frame, "buffer") else frame
        try:
            a = np.frombuffer(buf, dtype=dtype).reshape(shape) if nbytes(dtype, shape) else \
                np.empty(shape, dtype)
        except ValueError:        # e.g. [0, 2**62]: no bytes, and still too big for numpy
            raise BadArguments(f"{what} {i}: shape {list(shape)} is too large for an array") from None
        a.flags.writeable = False
        if dtype == np.bool_ and a.size and a.view(np.uint8).max() > 1:
            raise BadArguments(f"{what} {i}: bool tensor holds bytes other than 0 and 1")
        arrays.append(a)
    return arrays


def decode_arrays(headers, frames, max_bytes=DEFAULT_MAX_TENSOR_BYTES, what="input"):
    """Checked read-only arrays of a header list and its frames (see the module docstring)."""
    described = check_headers(headers, what)
    check_sizes(described, frames, max_bytes, what)
    return view_arrays(described, frames, what)
