"""Checkpoint files for the staging tests: safetensors written by hand, .ckpt protobuf values
built with MindSpore's own checkpoint_pb2 (so malformed ones can be made on purpose)."""
import json
import struct

import numpy as np

SAFETENSORS_DTYPE = {"float32": "F32", "float16": "F16", "int64": "I64", "int8": "I8", "uint16": "U16"}


def write_safetensors(path, tensors, dtype_names=None, metadata=None):
    """tensors: name -> array; dtype_names overrides the header dtype (e.g. "BF16" for uint16 bits)."""
    header, offset, blobs = {}, 0, []
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        dtype = (dtype_names or {}).get(name) or SAFETENSORS_DTYPE[array.dtype.name]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def ckpt_value(name, dims, tensor_type, content):
    """One serialized Checkpoint{value} record, as mindspore.save_checkpoint writes them."""
    from mindspore.train.checkpoint_pb2 import Checkpoint
    msg = Checkpoint()
    value = msg.value.add()
    value.tag = name
    value.tensor.dims.extend(dims)
    value.tensor.tensor_type = tensor_type
    value.tensor.tensor_content = content
    return msg.SerializeToString()


def bf16_bits(values):
    """bfloat16 bit patterns (round to nearest even) of float32 values, as uint16."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
