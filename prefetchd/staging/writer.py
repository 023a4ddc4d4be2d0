"""Writing tensors into a store, and the per-entry metadata they carry there."""

import numpy as np

from .. import dtypes
from .errors import StagingError
from .progress import Progress


tensor_meta = dtypes.store_meta      # the store metadata of a tensor (one format for every writer)


def read_meta(info):
    """(shape tuple, numpy dtype) of a store entry (`FileStore.info(key)`).

    A bfloat16 entry gives MindSpore's numpy bfloat16, which np.frombuffer,
    Tensor.from_numpy and Parameter.set_data accept. StagingError naming the
    entry and the field if the metadata is not prefetchd's or contradicts the
    entry's size.
    """
    shape, name = meta_fields(info)
    return shape, dtypes.numpy_dtype(name)


def meta_fields(info):
    """(shape tuple, prefetchd dtype name) of a store entry, checked; no numpy dtype (no MindSpore import)."""
    where = f"store entry {info.get('path') or info.get('key') or '?'}"
    if not bytes(info.get("meta") or b""):
        raise StagingError(f"{where}: has no tensor metadata (prefetchd 0.1.0 builds before this fix wrote none "
                           f"with the weights a daemon wrote back); stage the checkpoint again")
    try:
        shape, name = dtypes.parse_meta(info["meta"])
    except ValueError as e:
        raise StagingError(f"{where}: {e}") from None
    if "nbytes" in info and info["nbytes"] != dtypes.nbytes(shape, name):
        raise StagingError(f"{where}: holds {info['nbytes']} bytes, meta shape {list(shape)} of {name} "
                           f"needs {dtypes.nbytes(shape, name)}")
    return shape, name


def _byte_size(data):
    if isinstance(data, np.ndarray):
        return data.nbytes
    with memoryview(data) as view:
        return view.nbytes


def stage_tensors(store, tensors, progress=False, total=None):
    """Write (name, shape, dtype, buffer) items into an open store; returns the index.

    `store` needs only `write_sync(key, data, nbytes, meta)`. The index maps
    each name to {"shape", "dtype", "nbytes"}. A buffer whose size is not
    shape x dtype is refused (StagingError) before it is written. `progress`:
    False, True (a Progress on stderr) or a Progress. `total`: bytes expected
    (for the percentage); taken from `tensors.nbytes` when the iterable has it.
    """
    if progress is True:
        progress = Progress(total if total is not None else getattr(tensors, "nbytes", None),
                            getattr(tensors, "tensors", None))
    index, done = {}, 0
    for name, shape, dtype, data in tensors:
        dtype_name = dtypes.name_of(dtype)
        nbytes = _byte_size(data)
        need = dtypes.nbytes(shape, dtype_name)
        if nbytes != need:
            raise StagingError(f"tensor {name!r}: {nbytes} bytes given, shape {list(shape)} of "
                               f"{dtype_name} needs {need}")
        store.write_sync(name, data, nbytes, tensor_meta(shape, dtype_name))
        index[name] = {"shape": [int(d) for d in shape], "dtype": dtype_name, "nbytes": nbytes}
        done += nbytes
        if progress:
            progress.update(len(index), done)
    if progress:
        progress.finish()
    return index
