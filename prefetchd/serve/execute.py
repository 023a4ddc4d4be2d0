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
import logging
import time

import numpy as np

from ..control.codes import BadArguments
from .servable import output_arrays
from .wire import decode_arrays, encode_arrays

log = logging.getLogger("prefetchd.serve.worker")


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
        raise SplitError(f"an output of shape {list(out.shape)} has no axis {axis} of "
                         f"{sum(rows)} rows (the batch): it cannot be split per request")
    return np.split(out, np.cumsum(rows)[:-1], axis=axis)


class SplitError(RuntimeError):
    pass


def _split_all(outs, rows, axis):
    """[each part's outputs] of a joined batch's outputs."""
    pieces = [_split(out, rows, axis) for out in outs]
    return [[p[i] for p in pieces] for i in range(len(rows))]


def _alike(split, alone):
    """Whether a joined batch's split outputs are what each part computes alone (floats up to
    the rounding a different batch size brings)."""
    for mine, theirs in zip(split, alone):
        if len(mine) != len(theirs):
            return False
        for a, b in zip(mine, theirs):
            if a.shape != b.shape or a.dtype != b.dtype:
                return False
            if a.dtype.kind in "fc":
                rtol, atol = (2e-2, 1e-3) if a.dtype.itemsize <= 2 else (1e-4, 1e-6)
                if not np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True):
                    return False
            elif not np.array_equal(a, b):
                return False
    return True


# Joined batches of distinct requests checked against each request alone before a model's
# joined outputs are split unchecked.
JOIN_CHECKS = 3


def _distinct(parts):
    """Whether the parts' inputs are not all the same bytes (by bytes: NaN equals NaN here,
    as it does in the outputs' comparison)."""
    first = parts[0]
    return any(len(p) != len(first) or not all(_same_bytes(a, b) for a, b in zip(p, first))
               for p in parts[1:])


def _same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _forward_parts(model, parts, rows):
    """Each part's outputs. A joined forward's outputs are cut along output_batch_axis only
    for a model whose first JOIN_CHECKS joined batches of distinct requests were cut into
    what each part computes alone: an output whose rows are on another axis, or that has
    none (a state, a fixed vector), whose size there happens to equal the batch's rows, would
    be cut with no error. A model that fails a check runs its requests one at a time from
    then on. Identical requests (warm-up or health-check traffic) prove nothing about rows
    that depend on each other (batch statistics), so they run alone and do not count."""
    servable = model.servable
    if len(parts) == 1 or model.joins is False:
        return [output_arrays(servable.forward(*p)) for p in parts]
    axis = getattr(servable, "output_batch_axis", 0)
    outs = output_arrays(servable.forward(*_join(servable, parts)))
    try:
        split = _split_all(outs, rows, axis)
    except SplitError:
        split = None
    if model.joins is None:
        alone = [output_arrays(servable.forward(*p)) for p in parts]
        if split is not None and _alike(split, alone):
            model.join_checks += _distinct(parts)
            model.joins = True if model.join_checks >= JOIN_CHECKS else None
        else:
            model.joins = False
            log.warning("model %s: its outputs do not split into each request's rows along axis %s (shapes "
                        "%s joined, %s alone), or its rows depend on each other (batch statistics); its "
                        "requests run one at a time from now on (a servable object's output_batch_axis "
                        "says where the rows are)", model.name, axis,
                        [list(o.shape) for o in outs], [list(o.shape) for o in alone[0]])
        return alone
    if split is None:            # checked once, and the shapes changed since: never guess
        return [output_arrays(servable.forward(*p)) for p in parts]
    return split


def _check_output_sizes(arrays, max_bytes):
    """A reply's tensors are bounded as a request's are (per tensor): one over it is refused
    here, saying so, not shipped for the client to refuse as if its request were bad."""
    for i, a in enumerate(arrays):
        if a.nbytes > max_bytes:
            raise BadArguments(f"output {i} would be {a.nbytes} bytes ({list(a.shape)} of {a.dtype}), over "
                               f"the server's max_tensor_bytes of {max_bytes}: send fewer rows")


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
    if job.get("kind") == "generate":       # (batch, N) new ids: the rows are axis 0
        batched = _join(servable, parts)
        per_part = _split_all([np.asarray(servable.generate(batched[0], int(job["max_new_tokens"])))], rows, 0)
    else:
        per_part = _forward_parts(model, parts, rows)
    headers, out_frames = [], []
    for arrays in per_part:
        _check_output_sizes(arrays, max_bytes)
        h, f = encode_arrays(arrays)
        headers.append(h)
        out_frames.extend(f)
    return ({"outputs": headers, "batch": sum(rows),
             "compute_seconds": time.perf_counter() - started}, out_frames)
