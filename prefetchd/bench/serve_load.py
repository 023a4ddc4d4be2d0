"""Closed-loop load for a `prefetchd serve` front (`bench serve`'s clients):
`concurrency` requests outstanding on one DEALER socket, a new one sent the
moment one is answered, until `requests` have been sent and answered.

A request is an `infer` (the arrays `inputs`, prefetchd.serve.wire) or, with
`max_new_tokens`, a `generate` of that many tokens for the prompt `inputs[0]`.
Inputs are varied per request (VARIANTS seeded versions): the front joins a
model's requests only once joined batches of distinct requests split right, and
identical requests run alone (docs/control-plane.md), so a load of one repeated
input would measure unbatched serving while calling it batched.
Every reply is checked: an infer's outputs must have one row per input row, a
generate's tokens must be (rows, max_new_tokens); a reply that is not counts as
an error ("BAD_OUTPUT"), so a phase that "completed" really answered every
request with its own rows.
"""
import random
import time

import numpy as np

from ..serve.wire import decode_arrays, encode_arrays

BAD_OUTPUT = "BAD_OUTPUT"
NO_REPLY = "NO_REPLY"
VARIANTS = 16


def _variants(inputs, seed):
    """[(headers, buffers)] of VARIANTS versions of `inputs`: floats moved by seeded noise,
    integers (prompts) shuffled, so every id stays one the model takes."""
    rng = np.random.default_rng(seed)

    def varied(a):
        if np.issubdtype(a.dtype, np.floating):
            return (a + rng.standard_normal(a.shape)).astype(a.dtype)
        return rng.permutation(a.reshape(-1)).reshape(a.shape)
    return [encode_arrays([varied(a) for a in inputs]) for _ in range(VARIANTS)]


def percentile(values, q):
    """The q-quantile of `values` (nearest rank), None if there are none."""
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))
    return ordered[k]


def _reply_is_whole(result, frames, rows, max_new_tokens):
    """Whether a reply carries outputs for exactly the request's rows."""
    try:
        outputs = decode_arrays(result.get("outputs", []), frames, 1 << 30, what="output")
    except ValueError:
        return False
    if not outputs or any(o.ndim == 0 or o.shape[0] != rows for o in outputs):
        return False
    return max_new_tokens is None or outputs[0].shape == (rows, max_new_tokens)


def run_load(endpoint, models, requests, concurrency, hint, inputs, seed=0, timeout=900.0,
             max_new_tokens=None):
    """Closed-loop load (see the module docstring); models drawn at random per request.

    Returns {"requests", "completed", "errors" {code: n}, "seconds", "rps",
    "p50_seconds", "p99_seconds", "mean_seconds", "mean_batch_size", "tokens",
    "tokens_per_second"}: tokens count the generated ones (0 for infer).
    """
    import zmq

    from ..control import protocol as P

    rng = random.Random(seed)
    op = "infer" if max_new_tokens is None else "generate"
    rows = inputs[0].shape[0]
    variants = _variants(inputs, seed)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    latencies, batch_sizes, errors, sent, outstanding = [], [], {}, 0, {}
    started = time.perf_counter()
    try:
        while sent < requests or outstanding:
            while sent < requests and len(outstanding) < concurrency:
                rid = P.new_rid(sent)
                headers, buffers = variants[sent % len(variants)]
                body = {"model": rng.choice(models), "inputs": headers, "hint": hint}
                if max_new_tokens is not None:
                    body["max_new_tokens"] = max_new_tokens
                sock.send_multipart(P.encode_request(rid, op, body, timeout, buffers), copy=False)
                outstanding[rid] = time.perf_counter()
                sent += 1
            if not sock.poll(int(timeout * 1000) + 5000):
                errors[NO_REPLY] = errors.get(NO_REPLY, 0) + len(outstanding)
                break
            rid, doc, frames = P.decode_reply(sock.recv_multipart(), tensors=True)
            t0 = outstanding.pop(rid, None)
            if t0 is None:
                continue
            if not doc.get("ok"):
                errors[doc.get("code")] = errors.get(doc.get("code"), 0) + 1
            elif not _reply_is_whole(doc.get("result") or {}, frames, rows, max_new_tokens):
                errors[BAD_OUTPUT] = errors.get(BAD_OUTPUT, 0) + 1
            else:
                latencies.append(time.perf_counter() - t0)
                batch_sizes.append(doc["result"].get("batch_size", rows))
    finally:
        ctx.destroy(linger=0)
    seconds = time.perf_counter() - started
    tokens = len(latencies) * rows * (max_new_tokens or 0)
    return {"requests": requests, "concurrency": concurrency, "completed": len(latencies),
            "errors": errors, "seconds": seconds,
            "rps": len(latencies) / seconds if seconds else 0.0,
            "p50_seconds": percentile(latencies, 0.50), "p99_seconds": percentile(latencies, 0.99),
            "mean_seconds": sum(latencies) / len(latencies) if latencies else None,
            "mean_batch_size": sum(batch_sizes) / len(batch_sizes) if batch_sizes else None,
            "tokens": tokens, "tokens_per_second": tokens / seconds if seconds else 0.0}
