"""A worker runs one batch: the parts (requests) the front joined, concatenated
along each input's batch axis, one forward or generate for all of them, and the
outputs split back into each part's rows.

    job    {"model", "kind": "infer"|"generate", "parts": [{"inputs": [headers]}],
            "max_new_tokens": N (generate)}
    frames the parts' input frames, part after part
    result {"outputs": [[headers] per part], "batch": rows, "compute_seconds"}
           plus the output frames, part after part

The front checked every header against the model's signature; the frames are
checked again here (prefetchd.serve.wire) because a worker trusts no bytes it
has not measured.
"""
import time

import numpy as np

from ..control.codes import BadArguments
from .servable import output_arrays
from .wire import decode_arrays, encode_arrays


def _rows(servable, arrays):
    for spec, a in zip(servable.inputs, arrays):
        if spec.batch_axis is not None:
            return a.shape[spec.batch_axis]
    return 1


def _join(servable, parts):
    if len(parts) == 1:
        return parts[0]
    joined = []
    for i, spec in enumerate(servable.inputs):
        if spec.batch_axis is None:
            raise BadArguments(f"input {i} has no batch axis: its requests cannot be joined")
        joined.append(np.concatenate([p[i] for p in parts], axis=spec.batch_axis))
    return joined


def _split(out, rows, axis):
    if len(rows) == 1:
        return [out]
    if out.ndim <= axis or out.shape[axis] != sum(rows):
        raise RuntimeError(f"an output of shape {list(out.shape)} has no axis {axis} of "
                           f"{sum(rows)} rows (the batch): it cannot be split per request")
    return np.split(out, np.cumsum(rows)[:-1], axis=axis)


def run_batch(model, job, frames, max_bytes):
    """(result, output frames) of one batch job for `model` (a ServedModel)."""
    started = time.perf_counter()
    servable = model.servable
    parts, at = [], 0
    for part in job["parts"]:
        n = len(part["inputs"])
        parts.append(decode_arrays(part["inputs"], frames[at:at + n], max_bytes))
        at += n
    if at != len(frames):
        raise BadArguments(f"{len(frames) - at} frames beyond the parts' inputs")
    rows = [_rows(servable, p) for p in parts]
    batched = _join(servable, parts)
    if job.get("kind") == "generate":
        outs = [np.asarray(servable.generate(batched[0], int(job["max_new_tokens"])))]
        axis = 0
    else:
        outs = output_arrays(servable.forward(*batched))
        axis = getattr(servable, "output_batch_axis", 0)
    per_part = [[] for _ in parts]
    for out in outs:
        for i, piece in enumerate(_split(out, rows, axis)):
            per_part[i].append(piece)
    headers, out_frames = [], []
    for arrays in per_part:
        h, f = encode_arrays(arrays)
        headers.append(h)
        out_frames.extend(f)
    return ({"outputs": headers, "batch": sum(rows),
             "compute_seconds": time.perf_counter() - started}, out_frames)
