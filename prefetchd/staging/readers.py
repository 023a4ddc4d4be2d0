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


def verify_checkpoint(path):
    """Read a checkpoint whole and check its checksum, writing nothing.

    True if the file carries a checksum and it matches, False if it carries
    none; StagingError (naming the file) if it is malformed or damaged. For a
    consumer that stages into a live store and must not keep a damaged file's
    tensors (stage_checkpoint needs none of this: it commits only at the end).
    """
    reader = iter_checkpoint(path)
    try:
        if not reader.has_checksum:
            return False
        for _ in reader:
            pass
        return True
    finally:
        reader.close()
