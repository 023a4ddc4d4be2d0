"""Import checkpoints into a store (the remote tier) one tensor at a time.

`.safetensors` and MindSpore `.ckpt` files (BF16, sliced parameters over
512 MiB and `crc_check=True` trailers included) are read through mmap and
written tensor by tensor, so staging never holds more than one tensor in
RAM. Each stored version carries its shape and dtype in the store's own
metadata (checksummed with the header); `prefetchd-index.json` lists them
for people and tools. `stage_checkpoint` swaps in a complete new generation
of the store directory, every new tensor read back and checked first, or
leaves it as it was. Every refusal is a StagingError whose one-line message
names the file, the tensor and the field; headers are checked in time linear
in their size (checks: rank, shape products, names as store keys), FIFOs and
devices are refused before they are opened, overlapping entries are refused.

Modules: readers (ckpt, safetensors, over protobuf, mapped and checks), writer
(store metadata, stage_tensors), generations (stage_checkpoint, the index),
progress,
shards (stage_sharded: per-rank stores of a sharded model, one generation for all ranks).
"""
from .errors import CheckpointError, StagingError
from .generations import INDEX_FILE, read_index, stage_checkpoint, write_index
from .progress import Progress
from .shards import PER_RANK, SHARDS_FILE, parse_spec, read_shards, stage_sharded
from .readers import iter_checkpoint, iter_mindspore_ckpt, iter_safetensors, verify_checkpoint
from .writer import read_meta, stage_tensors, tensor_meta

__all__ = ["INDEX_FILE", "CheckpointError", "Progress", "StagingError", "iter_checkpoint",
           "iter_mindspore_ckpt", "iter_safetensors", "read_index", "read_meta", "stage_checkpoint",
           "stage_tensors", "tensor_meta", "verify_checkpoint", "write_index",
           "PER_RANK", "SHARDS_FILE", "parse_spec", "read_shards", "stage_sharded"]
