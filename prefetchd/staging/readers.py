"""Choosing a checkpoint reader by file name."""
from .ckpt import MindSporeCheckpoint
from .errors import StagingError
from .safetensors import SafetensorsCheckpoint

# The old generator names; each is now an iterator class with `tensors`/`nbytes` totals.
iter_safetensors = SafetensorsCheckpoint
iter_mindspore_ckpt = MindSporeCheckpoint


def iter_checkpoint(path):
    """An iterator of (name, shape, numpy dtype, buffer) over a .ckpt or .safetensors file.

    Opening checks the file's structure (StagingError naming the file and the
    field); checksums, when the file has one, are checked as iteration ends.
    """
    p = str(path)
    if p.endswith(".safetensors"):
        return SafetensorsCheckpoint(p)
    if p.endswith(".ckpt"):
        return MindSporeCheckpoint(p)
    raise StagingError(f"{p}: unknown checkpoint format (expected .ckpt or .safetensors)")
