"""A worker runs one batch: the parts (requests) the front joined, concatenated
along each input's batch axis, one forward or generate for all of them, and the
outputs split back into each part's rows.

    job    {"model", "kind": "infer"|"generate", "parts": [{"inputs": [headers],
            "deadline": the front's time.monotonic() past which nobody awaits it}],
            "max_new_tokens": N (generate)}
    frames the parts' input frames, part after part
    result {"outputs": [[headers] or None per part], "errors": {part index: {"code",
            "reason"}} (the parts that failed), "ran": [rows of the forward each part's
            outputs came from], "forwards": [rows of each forward run], "batch": rows,
            "compute_seconds", "started": time.monotonic() as the worker began it,
            "joined": whether this kind of call on this model runs joined (True), one
            request at a time (False), or is still being checked (None)} plus the output
            frames of the parts that succeeded

A part's failure is its own: when a joined forward or generate raises, each part runs
alone, so one request's bad input (a model that raises on NaN) fails that request only.

A part whose deadline passed before the worker reached it is not run (TIMEOUT): the
front answered it TIMEOUT already, and under overload such dead work, queued in the
worker's in-flight slots, kept live requests waiting until they timed out too. The
deadline is the front's monotonic clock, which is the machine's (CLOCK_MONOTONIC): a
batch waits in the worker's socket while the one before runs, so a relative time would
start late. A call already running is not interrupted.

The front checked every header against the model's signature; the frames are
checked again here (prefetchd.serve.wire) because a worker trusts no bytes it
has not measured.
"""
import logging
import time

import numpy as np

from ..control import protocol as P
from ..control.codes import BadArguments
from ..errors import StorageError
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


def _alike(split, alone, axis):
    """Whether a joined batch's split outputs are what each part computes alone: integers
    equal, floats up to the rounding a different batch size brings. An element near zero
    carries the rounding of the large ones it was summed from, so its tolerance is relative
    to the magnitudes around it (_tolerances); rows that depend on each other differ by far
    more."""
    if any(len(mine) != len(theirs) or any(a.shape != b.shape or a.dtype != b.dtype
                                           for a, b in zip(mine, theirs))
           for mine, theirs in zip(split, alone)):
        return False
    for o in range(len(alone[0]) if alone else 0):
        joined, reference = [mine[o] for mine in split], [theirs[o] for theirs in alone]
        if reference[0].dtype.kind not in "fc":
            if not all(np.array_equal(a, b) for a, b in zip(joined, reference)):
                return False
            continue
        tolerance = 2e-2 if reference[0].dtype.itemsize <= 2 else 1e-4
        rowed = all(b.ndim > axis for b in reference)     # the parts' rows, side by side
        a = np.concatenate(joined, axis) if rowed else None
        b = np.concatenate(reference, axis) if rowed else None
        pairs = [(a, b)] if rowed else list(zip(joined, reference))
        for a, b in pairs:
            if not np.allclose(a, b, rtol=tolerance, atol=_tolerances(b, tolerance), equal_nan=True):
                return False
    return True


def _tolerances(b, tolerance):
    """Per element: `tolerance` times the smallest of the largest finite magnitudes along
    each axis through it (axes of one element left out), or the output's low quantile of
    those (FLOOR_QUANTILE) when that is larger. The largest of the whole output was the
    scale, and one masked logit at -1e9 made every row's tolerance 1e5: a model whose rows
    depend on each other passed its checks and clients got each other's rows (an outside
    probe). Along some axis an element's neighbours are unmasked. The floor: two requests'
    rows side by side both near zero at one place made that element's scale 0.003, under the
    rounding carried from the large terms it was summed from (the demo model failed 2 checks
    in 150, and its batches ran unjoined); a mask covers far fewer than 90% of the elements."""
    width = np.float64 if np.abs(b[:0]).dtype == np.float64 else np.float32    # (outputs can be large)
    magnitude = np.where(np.isfinite(b), np.abs(b), 0).astype(width, copy=False)
    if magnitude.size == 0:
        return 1e-12
    scale = None
    for k in range(magnitude.ndim):
        if magnitude.shape[k] > 1:
            along = magnitude.max(axis=k, keepdims=True)
            scale = along if scale is None else np.minimum(scale, along)
    scale = magnitude if scale is None else np.broadcast_to(scale, magnitude.shape)
    floor = np.quantile(scale.flat[::max(1, scale.size // FLOOR_SAMPLE)], FLOOR_QUANTILE)
    return tolerance * np.maximum(scale, floor) + 1e-12


FLOOR_QUANTILE = 0.1         # of the elements' scales: the floor of every element's (_tolerances)
FLOOR_SAMPLE = 1 << 20       # elements read for it (a large logits output is sampled)


# Joined batches of distinct requests checked against each request alone before a model's
# joined outputs are split unchecked.
JOIN_CHECKS = 3


def _distinct(parts):
    """Whether the parts' inputs are not all the same bytes (by bytes: NaN equals NaN here,
    as it does in the outputs' comparison)."""
    first = parts[0]
    return any(len(p) != len(first) or not all(_same_bytes(a, b) for a, b in zip(p, first))
               for p in parts[1:])


def _rows_differ(outputs, axis):
    """Whether the rows (along `axis`, across all the parts' outputs) are not all the same
    bytes: only then could a joined call that moved rows be seen."""
    rows = set()
    for outs in outputs:
        n = outs[0].shape[axis] if outs and outs[0].ndim > axis else 0
        for r in range(n):
            rows.add(b"".join(np.take(o, r, axis=axis).tobytes() if o.ndim > axis else b"" for o in outs))
    return len(rows) > 1


def _same_bytes(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


class Outcomes:
    """Each part's outputs or error, the rows of the forward each came from, and the forwards run."""

    def __init__(self, n, worker, deadlines=None):
        self.outputs, self.errors, self.ran, self.forwards = [None] * n, {}, [0] * n, []
        self.worker = worker           # its index, named in the errors' reasons
        self.deadlines = deadlines or [None] * n

    def expired(self, i):
        """Whether part i's deadline passed (its error set then: it is not run)."""
        deadline = self.deadlines[i]
        if deadline is None or time.monotonic() < deadline:
            return False
        self.errors[i] = {"code": P.TIMEOUT, "reason": f"worker {self.worker}: its deadline passed before "
                                                       f"the worker reached it (busy with earlier requests); not run"}
        return True

    def all_expired(self):
        """Whether every part expired; each one that did has its error set (all are asked)."""
        return all([self.expired(i) for i in range(len(self.outputs))])

    def alone(self, parts, rows, run):
        """Run each part by itself: `run(part)` -> its outputs."""
        for i in range(len(parts)):
            if self.expired(i):
                continue
            self.forwards.append(rows[i])
            try:
                self.outputs[i], self.ran[i] = run(parts[i]), rows[i]
            except Exception as e:       # noqa: BLE001 - this part's own error, replied to its client
                self.errors[i] = error_reply(e, self.worker)

    def joined(self, split, rows):
        self.outputs, self.ran = split, [sum(rows)] * len(rows)


def without_framework_stack(message):
    """A MindSpore error's message without the "C++ Call Stack: (For framework developers)"
    section it ends in: a client's reason and the front's start failure are one line."""
    cut = message.find("C++ Call Stack")
    return message if cut < 0 else message[:cut].rstrip(" -\n") or message


def error_reply(e, worker=None):
    """{"code", "reason"} a client gets for an exception raised running its request."""
    if isinstance(e, BadArguments):
        return {"code": P.BAD_REQUEST, "reason": str(e)}
    log.warning("worker %s: request failed", worker if worker is not None else "?", exc_info=e)
    # A weight that failed its checksum or could not be read is the store's fault, and says so
    # (STORAGE); anything else raised inside the model is the server's.
    code = P.STORAGE if isinstance(e, StorageError) else P.INTERNAL
    reason = without_framework_stack(str(e))
    return {"code": code, "reason": f"worker {worker}: {reason}" if worker is not None else reason}


_FAILED = object()                       # the joined call raised


def _run_parts(model, kind, run, parts, rows, axis, worker, deadlines):
    """Each part's Outcomes of one batch of `kind` ("infer" or "generate"); `run(arrays)` -> a
    call's output arrays. The joined call's outputs are cut along `axis` only for a model whose
    first JOIN_CHECKS joined batches of distinct requests were cut into what each part computes
    alone: an output whose rows are on another axis, or that has none (a state, a fixed
    vector), whose size there happens to equal the batch's rows, would be cut with no error,
    and a generate that reorders its rows would hand clients each other's tokens. Until then
    each part runs alone and is answered from that, and the joined call that checks the model
    waits in `JoinCheck.pending` until the worker has replied (finish_join_checks): checked
    first, a batch of n parts cost n + 1 forwards before any reply, and a slow model's joined
    requests timed out while each alone was answered in time. A model that fails a check runs
    that kind of call one request at a time from then on. A joined call that raises runs each
    part alone: the failure is one part's own."""
    check = model.joins[kind]
    done = Outcomes(len(parts), worker, deadlines)
    if done.all_expired():
        return done
    if len(parts) == 1 or check.verdict is not True:
        done.alone(parts, rows, run)
        if check.verdict is None:
            check.pending = _join_check(model, kind, run, parts, rows, axis, done)
        return done
    try:
        outs = run(_join(model.servable, parts))
    except Exception:                    # noqa: BLE001 - whose input was it? each runs alone
        outs = _FAILED
    if outs is _FAILED:                  # (outside the except: a part's own error is logged alone,
        done.alone(parts, rows, run)     # not chained to the joined call's)
        return done
    done.forwards.append(sum(rows))
    try:
        done.joined(_split_all(outs, rows, axis), rows)
    except SplitError:                   # checked, and the shapes changed since: never guess
        done.alone(parts, rows, run)
    return done


def _join_check(model, kind, run, parts, rows, axis, done):
    """The check of a joined call against the parts that ran alone (one whose deadline passed
    left out), or None when they show nothing: fewer than two, all the same bytes (warm-up or
    health-check traffic: identical rows prove nothing about rows that depend on each other),
    or a part's own error among them."""
    ran = [i for i in range(len(parts)) if i not in done.errors]
    if len(ran) < 2 or any(e["code"] != P.TIMEOUT for e in done.errors.values()):
        return None
    parts = [parts[i] for i in ran]
    if not _distinct(parts):
        return None
    alone, rows = [done.outputs[i] for i in ran], [rows[i] for i in ran]
    return lambda: _check_join(model, kind, run(_join(model.servable, parts)), rows, axis, alone)


def checks_fit(next_parts, seconds_per_forward, now):
    """Whether the join checks the last batch left (its joined call, taken as two forwards)
    can run before the next batch, received already (`next_parts`, its parts' documents),
    with every part of it still done by its deadline, each part taken as one forward of
    `seconds_per_forward` (the last batch's). Run regardless, the check's forward came ahead
    of the next batch and timed its last requests out (an outside probe: 10 requests of 1 s
    on 2 workers under --request-timeout 6.5, 2 TIMEOUT); put off, it runs once the worker
    is idle or has the time."""
    deadlines = [d for d in map(_deadline, next_parts) if d is not None]
    if not deadlines:
        return True
    return now + seconds_per_forward * (2 + len(next_parts)) <= min(deadlines)


def finish_join_checks(models):
    """Run the join checks the last batch left pending (the worker calls this once it has
    replied). A check that fails to run shows nothing; it never fails the worker."""
    for model in models:
        for kind, check in model.joins.items():
            pending, check.pending = check.pending, None
            if pending is not None:
                try:
                    pending()
                except Exception:        # noqa: BLE001 - the joined call raised: no verdict
                    log.debug("model %s: a joined %s check raised", model.name, kind, exc_info=True)


def _check_join(model, kind, outs, rows, axis, alone):
    check = model.joins[kind]
    try:
        split = _split_all(outs, rows, axis)
    except SplitError:
        split = None
    if split is not None and _alike(split, alone, axis):
        # Rows whose outputs are all the same show no reordering: distinct prompts whose
        # tokens coincided passed three checks of a generate that reversed its rows. (Rows
        # only partly alike still show most; requiring all to differ, a small LM's few
        # likely tokens kept its generates from ever joining.)
        if _rows_differ(alone, axis):
            check.checks += 1
            check.verdict = True if check.checks >= JOIN_CHECKS else None
        return
    check.verdict = False
    log.warning("model %s: its %s outputs do not split into each request's rows along axis %s "
                "(shapes %s joined, %s alone), or its rows depend on each other (batch statistics, "
                "a reordering); its %s requests run one at a time from now on (a servable "
                "object's output_batch_axis says where a forward's rows are)", model.name, kind,
                axis, [list(o.shape) for o in outs], [list(o.shape) for o in alone[0]], kind)


def _forward_parts(model, parts, rows, worker, deadlines):
    """Each part's Outcomes of a forward, its outputs split along the servable's output_batch_axis."""
    servable = model.servable
    return _run_parts(model, "infer", lambda arrays: output_arrays(servable.forward(*arrays)), parts, rows,
                      getattr(servable, "output_batch_axis", 0), worker, deadlines)


def _generate_parts(model, parts, rows, max_new_tokens, worker, deadlines):
    """Each part's Outcomes of a generate ((batch, N) new ids: the rows are axis 0)."""
    servable = model.servable

    def generate(arrays):
        return [_new_tokens(servable.generate(arrays[0], max_new_tokens), arrays[0], max_new_tokens)]
    return _run_parts(model, "generate", generate, parts, rows, 0, worker, deadlines)


def _new_tokens(out, prompt, n):
    """A generate's result as what the wire promises, (prompt rows, n) int64; anything else is
    the servable's fault (INTERNAL), not an answer: prompt + new ids, floats, a row short."""
    tokens = np.asarray(out)
    if tokens.shape != (prompt.shape[0], n) or tokens.dtype.kind not in "iu":
        raise ValueError(f"the model's generate returned {list(tokens.shape)} of {tokens.dtype} for "
                         f"{prompt.shape[0]} prompt rows: a servable's generate returns the new token ids, "
                         f"(rows, max_new_tokens={n}) integers")
    return tokens.astype(np.int64, copy=False)


def _check_output_sizes(arrays, max_bytes):
    """A reply's tensors are bounded as a request's are (per tensor): one over it is refused
    here, saying so, not shipped for the client to refuse as if its request were bad."""
    for i, a in enumerate(arrays):
        if a.nbytes > max_bytes:
            raise BadArguments(f"output {i} would be {a.nbytes} bytes ({list(a.shape)} of {a.dtype}), over "
                               f"the server's limit of {max_bytes} (--max-request-bytes): send fewer rows")


def run_batch(model, job, frames, max_bytes, worker=None):
    """(result, output frames) of one batch job for `model` (a ServedModel) on worker `worker`."""
    began, started = time.monotonic(), time.perf_counter()
    servable = model.servable
    parts, at = [], 0
    for part in job["parts"]:
        n = len(part["inputs"])
        parts.append(decode_arrays(part["inputs"], frames[at:at + n], max_bytes))
        at += n
    if at != len(frames):
        raise BadArguments(f"{len(frames) - at} frames beyond the parts' inputs")
    rows = [_rows(servable, p) for p in parts]
    deadlines = [_deadline(part) for part in job["parts"]]
    kind = "generate" if job.get("kind") == "generate" else "infer"
    if kind == "generate":
        done = _generate_parts(model, parts, rows, int(job["max_new_tokens"]), worker, deadlines)
    else:
        done = _forward_parts(model, parts, rows, worker, deadlines)
    headers, out_frames = [], []
    for i, arrays in enumerate(done.outputs):
        if i not in done.errors:
            try:       # outputs too large, or that the wire cannot carry: this part's own error
                _check_output_sizes(arrays, max_bytes)
                h, f = encode_arrays(arrays)
            except (BadArguments, TypeError, ValueError) as e:
                done.errors[i] = error_reply(e, worker)
        if i in done.errors:
            headers.append(None)
            continue
        headers.append(h)
        out_frames.extend(f)
    return ({"outputs": headers, "errors": {str(i): e for i, e in done.errors.items()}, "ran": done.ran,
             "forwards": done.forwards, "batch": sum(rows),
             "compute_seconds": time.perf_counter() - started, "started": began,
             "joined": model.joins[kind].verdict}, out_frames)


def _deadline(part):
    """A part's deadline (the front's time.monotonic()), None if it has none."""
    deadline = part.get("deadline")
    return float(deadline) if isinstance(deadline, (int, float)) and not isinstance(deadline, bool) else None
