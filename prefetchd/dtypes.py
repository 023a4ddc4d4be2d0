"""Tensor element types by name: checkpoint spellings <-> numpy <-> MindSpore, bfloat16 included.

A dtype travels through prefetchd as its numpy name ("float32", "bfloat16"):
that is what the store's tensor metadata and the index record. numpy has no
bfloat16 of its own; MindSpore registers one when imported (2 bytes;
`np.dtype("bfloat16")` works from then on). Importing MindSpore takes seconds,
so it happens only when a bfloat16 is actually turned into a numpy dtype; sizes
and names never need it. A MindSpore dtype is read by its name (`str(mindspore.
float32)` is "Float32"): `mindspore.dtype_to_nptype` is deprecated and logs a
warning on every call.
"""
import numpy as np

# bytes per element, by prefetchd (numpy) name
ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1, "complex64": 8, "complex128": 16,
}

# safetensors header "dtype" -> prefetchd name
SAFETENSORS = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
}

# MindSpore .ckpt TensorProto.tensor_type (str(mindspore dtype)) -> prefetchd name
MINDSPORE_CKPT = {
    "Float64": "float64", "Float32": "float32", "Float16": "float16", "BFloat16": "bfloat16",
    "Int64": "int64", "Int32": "int32", "Int16": "int16", "Int8": "int8",
    "UInt64": "uint64", "UInt32": "uint32", "UInt16": "uint16", "UInt8": "uint8", "Bool": "bool",
    "Complex64": "complex64", "Complex128": "complex128",
}


def itemsize(name):
    """Bytes per element of a prefetchd dtype name; KeyError if prefetchd does not know it."""
    return ITEMSIZE[name]


def nbytes(shape, name):
    """Bytes of a C-contiguous tensor (exact: Python ints, no overflow); a scalar is one element."""
    count = 1
    for d in shape:
        count *= int(d)
    return count * ITEMSIZE[name]


def name_of(dtype):
    """The prefetchd name of a numpy dtype, a numpy scalar type, a MindSpore dtype, or a name."""
    if isinstance(dtype, str):
        if dtype in ITEMSIZE:
            return dtype
        return numpy_dtype(dtype).name
    if isinstance(dtype, (np.dtype, type)):
        return np.dtype(dtype).name
    # a MindSpore dtype (mindspore.float32, mindspore.bfloat16)
    name = MINDSPORE_CKPT.get(str(dtype))
    if name is None:
        raise TypeError(f"dtype {dtype} has no numpy equivalent")
    return name


def store_meta(shape, dtype):
    """The metadata a store entry carries: JSON {"shape": [...], "dtype": prefetchd name}.
    Every writer of a store uses it (staging, and the daemon's placements and write-backs:
    an entry written back with none could no longer be opened from the store)."""
    import json
    return json.dumps({"shape": [int(d) for d in shape], "dtype": name_of(dtype)}).encode()


def parse_meta(meta):
    """(shape tuple, dtype name) that store_meta's JSON `meta` records; ValueError saying what
    else it is."""
    import json
    try:
        doc = json.loads(bytes(meta).decode())
        shape, name = doc["shape"], doc["dtype"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"meta is not prefetchd tensor metadata ({type(e).__name__}: {e})") from None
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise ValueError(f"meta shape {shape!r} is not a list of non-negative integers")
    if name not in ITEMSIZE:
        raise ValueError(f"meta dtype {name!r} has no numpy equivalent")
    return tuple(shape), name


def meta_layout(meta):
    """parse_meta's (shape, dtype name), or None when `meta` records none or something else
    (older entries: then only sizes compare)."""
    try:
        return parse_meta(meta) if meta else None
    except ValueError:
        return None


def known_name(dtype):
    """The prefetchd name of `dtype`, or its str() when prefetchd has none (to compare and name)."""
    try:
        return name_of(dtype)
    except TypeError:
        return str(dtype)


def numpy_dtype(name):
    """np.dtype for a prefetchd name; "bfloat16" is MindSpore's numpy bfloat16 (imported on demand).

    Raises TypeError for a name numpy and MindSpore do not know.
    """
    if isinstance(name, np.dtype):
        return name
    try:
        return np.dtype(name)
    except TypeError:
        if name != "bfloat16":
            raise TypeError(f"dtype {name!r} has no numpy equivalent") from None
    _mindspore()          # registers numpy's bfloat16
    return np.dtype("bfloat16")


def mindspore_dtype(name):
    """The MindSpore dtype of a prefetchd name (mindspore.bfloat16 for "bfloat16")."""
    if name not in ITEMSIZE:
        raise TypeError(f"dtype {name!r} has no MindSpore equivalent")
    return getattr(_mindspore(), "bool_" if name == "bool" else name)


def _mindspore():
    import mindspore
    return mindspore
