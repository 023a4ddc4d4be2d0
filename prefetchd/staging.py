"""Import checkpoints into a store (the remote tier) one tensor at a time.

`.safetensors` (8-byte header length, JSON header, raw data) and MindSpore
`.ckpt` (protobuf: repeated Value{tag, TensorProto{dims, tensor_type,
tensor_content}}) are read through mmap and written tensor by tensor, so
staging never holds more than one tensor — let alone the whole model — in
RAM. Each stored version carries its shape and dtype in the store's own
metadata (checksummed with the header); `prefetchd-index.json` lists them for
people and tools.
"""
import json
import mmap
import os
import sys
import time

import numpy as np

from . import _native

INDEX_FILE = "prefetchd-index.json"

_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_MINDSPORE_DTYPES = {"Float64": "float64", "Float32": "float32", "Float16": "float16",
                     "Int64": "int64", "Int32": "int32", "Int16": "int16", "Int8": "int8",
                     "UInt8": "uint8", "Bool": "bool"}


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read; the message names the file and what is wrong."""


def tensor_meta(shape, dtype):
    return json.dumps({"shape": list(shape), "dtype": np.dtype(dtype).name}).encode()


def read_meta(info):
    """(shape, dtype) from a store entry's metadata."""
    try:
        meta = json.loads(bytes(info["meta"]).decode())
        return tuple(meta["shape"]), np.dtype(meta["dtype"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"store entry {info.get('path')} has no prefetchd tensor metadata: {e}") from None


# ---------------------------------------------------------------- readers
def iter_safetensors(path):
    """(name, shape, numpy dtype, memoryview of the bytes) for each tensor, in file order."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if len(mm) < 8:
            raise CheckpointError(f"{path}: too short for a safetensors header")
        n = int.from_bytes(mm[:8], "little")
        if n > len(mm) - 8:
            raise CheckpointError(f"{path}: header length {n} runs past the end of the file")
        try:
            header = json.loads(bytes(mm[8:8 + n]))
        except ValueError as e:
            raise CheckpointError(f"{path}: header is not JSON: {e}") from None
        base = 8 + n
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                         key=lambda kv: kv[1]["data_offsets"][0])
        view = memoryview(mm)
        for name, spec in entries:
            dtype = _SAFETENSORS_DTYPES.get(spec.get("dtype"))
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {name!r} has dtype {spec.get('dtype')!r}, "
                                      f"which has no numpy equivalent")
            start, end = spec["data_offsets"]
            shape = tuple(spec["shape"])
            expected = int(np.prod(shape)) * np.dtype(dtype).itemsize if shape else np.dtype(dtype).itemsize
            if end - start != expected or base + end > len(mm):
                raise CheckpointError(f"{path}: tensor {name!r} spans {end - start} bytes, "
                                      f"shape {shape} of {dtype} needs {expected}")
            yield name, shape, np.dtype(dtype), view[base + start:base + end]
            _forget(mm, base + start, end - start)
        view.release()
    finally:
        try:
            mm.close()
        except BufferError:
            pass   # a caller still holds a slice; the mapping goes with it


def _forget(mm, start, length):
    """Unmap the pages of a tensor already written, so RSS holds one tensor at a time."""
    page = mmap.PAGESIZE
    lo = start - start % page
    hi = min(len(mm), start + length)
    if hi > lo:
        mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def _varint(buf, pos):
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise CheckpointError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise CheckpointError("varint too long")


def _fields(buf, start, end):
    """(field number, wire type, value or (offset, length)) of one protobuf message."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
            yield field, wire, value
        elif wire == 2:
            length, pos = _varint(buf, pos)
            if pos + length > end:
                raise CheckpointError("field runs past its message")
            yield field, wire, (pos, length)
            pos += length
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        else:
            raise CheckpointError(f"unsupported protobuf wire type {wire}")


def iter_mindspore_ckpt(path):
    """(name, shape, numpy dtype, memoryview) for each tensor of a MindSpore .ckpt."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    view = memoryview(mm)
    try:
        for field, wire, value in _fields(mm, 0, len(mm)):
            if field != 1 or wire != 2:
                continue
            name, tensor = None, None
            for f2, w2, v2 in _fields(mm, value[0], value[0] + value[1]):
                if f2 == 1 and w2 == 2:
                    name = bytes(mm[v2[0]:v2[0] + v2[1]]).decode()
                elif f2 == 2 and w2 == 2:
                    tensor = v2
            if name is None or tensor is None:
                raise CheckpointError(f"{path}: a checkpoint value without a name or tensor")
            dims, dtype_name, content = [], None, (0, 0)
            for f3, w3, v3 in _fields(mm, tensor[0], tensor[0] + tensor[1]):
                if f3 == 1 and w3 == 0:
                    dims.append(v3)
                elif f3 == 1 and w3 == 2:       # packed dims
                    p, stop = v3[0], v3[0] + v3[1]
                    while p < stop:
                        d, p = _varint(mm, p)
                        dims.append(d)
                elif f3 == 2 and w3 == 2:
                    dtype_name = bytes(mm[v3[0]:v3[0] + v3[1]]).decode()
                elif f3 == 3 and w3 == 2:
                    content = v3
            dtype = _MINDSPORE_DTYPES.get(dtype_name)
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {name!r} has type {dtype_name!r}, "
                                      f"which has no numpy equivalent")
            shape = tuple(dims)
            expected = int(np.prod(shape)) * np.dtype(dtype).itemsize if shape else np.dtype(dtype).itemsize
            if content[1] != expected:
                raise CheckpointError(f"{path}: tensor {name!r} holds {content[1]} bytes, "
                                      f"shape {shape} of {dtype} needs {expected}")
            yield name, shape, np.dtype(dtype), view[content[0]:content[0] + content[1]]
            _forget(mm, content[0], content[1])
    finally:
        view.release()
        try:
            mm.close()
        except BufferError:
            pass


def iter_checkpoint(path):
    if str(path).endswith(".safetensors"):
        return iter_safetensors(path)
    if str(path).endswith(".ckpt"):
        return iter_mindspore_ckpt(path)
    raise CheckpointError(f"{path}: unknown checkpoint format (expected .ckpt or .safetensors)")


# ---------------------------------------------------------------- writing
def stage_tensors(store, tensors, progress=False, total=None):
    """Write (name, shape, dtype, buffer) items into an open FileStore; returns the index.

    `store` needs only `write_sync(key, data, nbytes, meta)`.
    """
    index, done, started = {}, 0, time.monotonic()
    for name, shape, dtype, data in tensors:
        nbytes = len(data) if isinstance(data, memoryview) else np.asarray(data).nbytes
        store.write_sync(name, data, nbytes, tensor_meta(shape, dtype))
        index[name] = {"shape": list(shape), "dtype": dtype.name, "nbytes": nbytes}
        done += nbytes
        if progress:
            rate = done / max(1e-9, time.monotonic() - started) / 1e6
            of = f" / {total / 2**20:.0f}" if total else ""
            print(f"\rstaged {len(index)} tensors, {done / 2**20:.0f}{of} MiB, {rate:.0f} MB/s",
                  end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return index


def write_index(directory, index):
    tmp = os.path.join(directory, INDEX_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "tensors": index}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, INDEX_FILE))


def stage_checkpoint(path, store_dir, progress=False):
    """Import a .ckpt or .safetensors file into the store at store_dir."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file")
    os.makedirs(store_dir, exist_ok=True)
    started = time.monotonic()
    store = _native.FileStore(store_dir)
    try:
        index = stage_tensors(store, iter_checkpoint(path), progress, os.path.getsize(path))
    finally:
        store.close()
    write_index(store_dir, index)
    seconds = time.monotonic() - started
    total = sum(t["nbytes"] for t in index.values())
    return {"checkpoint": str(path), "store": store_dir, "tensors": len(index), "bytes": total,
            "seconds": round(seconds, 3), "MBps": round(total / max(seconds, 1e-9) / 1e6, 1)}
