"""Checks both checkpoint readers apply to each tensor's name and shape before anything is staged.

Each returns a one-line reason (None when the value is fine) for the reader to
prefix with the file and the tensor, and each takes time linear in its input:
a hostile header can be large (100 MiB of JSON, a protobuf of any size) and an
exact product of 100,000 dimensions is quadratic (and has too many digits for
str()), so the rank is bounded before any product is taken. And a JSON object that
names a key twice (a safetensors header, a sharding spec) is refused, where json kept
the last without a word (errors.unique_keys).
"""
MAX_KEY_BYTES = 1024          # the FileStore's key limit (prefetchd._native.MAX_KEY_BYTES)
MAX_RANK = 32                 # numpy<2's NPY_MAXDIMS: a tensor of higher rank cannot be loaded
MAX_TENSOR_BYTES = (1 << 63) - 1   # numpy refuses arrays whose size overflows a signed 64-bit count
SHOWN = 80                    # characters of a hostile value quoted in a message


def shown(value):
    """repr(value), cut to a readable length (a name or shape may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


def name_problem(name):
    """Why `name` cannot be a store key (str of 1..MAX_KEY_BYTES bytes of UTF-8), or None."""
    if not isinstance(name, str):
        return f"name {shown(name)} is not a string"
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        return "name cannot be encoded as UTF-8 (a lone surrogate)"
    if size == 0:
        return "name is empty (a store key needs 1 to 1024 bytes)"
    if "\0" in name:
        return "name contains a NUL character (a daemon could never register it)"
    if size > MAX_KEY_BYTES:
        return f"name is {size} bytes of UTF-8; a store key holds at most {MAX_KEY_BYTES}"
    return None


def shape_problem(shape, itemsize):
    """Why a shape (a sequence of ints, already known non-negative) cannot be staged, or None."""
    if len(shape) > MAX_RANK:
        return f"shape has {len(shape)} dimensions; at most {MAX_RANK} can be loaded (numpy's limit)"
    size = itemsize
    for d in shape:
        if d:
            size *= d                 # at most MAX_RANK products of at most 64-bit numbers
    if size > MAX_TENSOR_BYTES:
        return (f"shape {shown(list(shape))} overflows: its elements times {itemsize} bytes "
                f"exceed 2**63-1 bytes")
    return None
