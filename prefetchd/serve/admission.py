"""What the front checks before it queues a request: its tensor headers and
frames (prefetchd.serve.wire) against the model's signature (rank, dtype,
non-batch dimensions, id bounds), the batch size they agree on, and the key
that says which requests can be joined into one batch. Every failure is a
BadArguments naming the tensor; nothing is queued then.
"""
from dataclasses import dataclass

import numpy as np

from ..control.codes import BadArguments
from .tensor_spec import TensorSpec
from .wire import check_headers, check_sizes, view_arrays

MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class ModelInfo:
    """What a worker's READY says about one model."""
    inputs: tuple
    generates: bool

    @classmethod
    def from_json(cls, doc):
        return cls(tuple(TensorSpec.from_json(d) for d in doc["inputs"]), bool(doc["generate"]))


def admit(info, kind, headers, frames, max_bytes, max_new_tokens=None):
    """(rows, batch key) of a request for a model described by `info` (a ModelInfo)."""
    if kind == "generate":
        if not info.generates:
            raise BadArguments("this model has no generate method; use infer")
        if max_new_tokens is None:
            raise BadArguments("generate needs 'max_new_tokens'")
    described = check_headers(headers)
    if len(described) != len(info.inputs):
        raise BadArguments(f"{len(described)} inputs, the model takes {len(info.inputs)}")
    if kind == "generate":       # (before the spec's own refusal of an empty axis: says why)
        for i, (_, shape) in enumerate(described):
            if len(shape) == 2 and shape[1] == 0:
                raise BadArguments(f"input {i}: shape {list(shape)} is empty: generate needs a prompt "
                                   f"of at least one token per row")
            if len(shape) == 2 and shape[0] == 0:
                raise BadArguments(f"input {i}: shape {list(shape)} has no rows: an empty batch")
    for i, (spec, (dtype, shape)) in enumerate(zip(info.inputs, described)):
        spec.check(i, dtype, shape)
    check_sizes(described, frames, max_bytes)
    # Values are read here when a bound is to be checked or a bool input could hold other
    # bytes than 0 and 1 (view_arrays refuses those): left to the worker, one such
    # request failed every request joined into its batch.
    if any(spec.high is not None for spec in info.inputs) or \
            any(dtype == np.bool_ for dtype, _ in described):
        for i, (spec, a) in enumerate(zip(info.inputs, view_arrays(described, frames))):
            spec.check_values(i, a)
    rows = {shape[spec.batch_axis] for spec, (_, shape) in zip(info.inputs, described)
            if spec.batch_axis is not None}
    if len(rows) > 1:
        raise BadArguments(f"inputs disagree on the batch size: {sorted(rows)}")
    batchable = all(spec.batch_axis is not None for spec in info.inputs)
    rest = tuple((dtype.name, tuple(d for a, d in enumerate(shape) if a != spec.batch_axis))
                 for spec, (dtype, shape) in zip(info.inputs, described))
    # Requests join only with ones of the same kind, shapes (bar the batch axis) and
    # generation length; a model with an unbatchable input never joins requests.
    key = (kind, rest, max_new_tokens) if batchable else None
    return (rows.pop() if rows else 1), key
