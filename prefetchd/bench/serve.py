"""`prefetchd bench serve`: a closed-loop load generator for a `prefetchd serve`
front, and the benchmark that compares requests/s and latency with and without
prefetch hints against the same warm workers."""
import os
import random
import time


def _percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, int(round(q * (len(ordered) - 1)))))
    return ordered[k]


def run_load(endpoint, models, requests, concurrency, hint, inputs, seed=0, timeout=60.0):
    """Closed-loop load: `concurrency` requests outstanding, models drawn at random,
    each request carrying the arrays `inputs` (prefetchd.serve.wire).

    Returns {"requests", "errors", "seconds", "rps", "p50_seconds", "p99_seconds", ...}.
    """
    import zmq

    from ..control import protocol as P
    from ..serve.wire import encode_arrays

    rng = random.Random(seed)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    headers, buffers = encode_arrays(inputs)
    latencies, errors, sent, outstanding = [], {}, 0, {}
    started = time.perf_counter()
    try:
        while sent < requests or outstanding:
            while sent < requests and len(outstanding) < concurrency:
                rid = P.new_rid(sent)
                body = {"model": rng.choice(models), "inputs": headers, "hint": hint}
                sock.send_multipart(P.encode_request(rid, "infer", body, timeout, buffers),
                                    copy=False)
                outstanding[rid] = time.perf_counter()
                sent += 1
            if not sock.poll(int(timeout * 1000)):
                errors["NO_REPLY"] = errors.get("NO_REPLY", 0) + len(outstanding)
                break
            rid, doc, _ = P.decode_reply(sock.recv_multipart(), tensors=True)
            t0 = outstanding.pop(rid, None)
            if t0 is None:
                continue
            if doc.get("ok"):
                latencies.append(time.perf_counter() - t0)
            else:
                errors[doc.get("code")] = errors.get(doc.get("code"), 0) + 1
    finally:
        ctx.destroy(linger=0)
    seconds = time.perf_counter() - started
    return {"requests": requests, "completed": len(latencies), "errors": errors,
            "seconds": seconds, "rps": len(latencies) / seconds if seconds else 0.0,
            "p50_seconds": _percentile(latencies, 0.50), "p99_seconds": _percentile(latencies, 0.99),
            "mean_seconds": sum(latencies) / len(latencies) if latencies else None}


def _median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def bench_serve(args):
    """`prefetchd bench serve`: requests/s and latency p50/p99 with and without prefetch hints.

    Starts a front and `--workers` workers in-process, then alternates phases with
    hints off and on (`--repeats` each, `--requests` per phase, default 60; models
    `--hidden` wide, default 256). Three weight sets per worker, picked at random per
    request, so most requests switch models. Both modes run against the same warm workers, so the
    ratios compare like with like on a noisy machine.
    """
    from ..demo.model import estimate_bytes
    from ..serve import Front, ServeSpec

    workers = max(1, int(getattr(args, "workers", 2) or 2))
    hidden = getattr(args, "hidden", None) or 256
    layers = getattr(args, "layers", None) or 4
    requests = getattr(args, "requests", None) or 60
    repeats = max(1, int(getattr(args, "repeats", 2) or 2))
    models = 3
    model_bytes = estimate_bytes(hidden, layers)
    # --budget is a fraction of a worker's weights (all its models), as for `bench model`,
    # but at least 1.25 models: one model streaming plus room for the hinted next one.
    fraction = getattr(args, "budget", 0.5) or 0.5
    spec = ServeSpec(models=models, hidden=hidden, layers=layers,
                     budget=max(fraction * models, 1.25), lookahead=getattr(args, "lookahead", 2) or 2,
                     store_dir=getattr(args, "dir", None))
    concurrency = 2 * workers
    front = Front(f"ipc://bench-serve-{os.getpid()}.sock", workers=workers, spec=spec,
                  request_timeout=120.0, name=f"bench-{os.getpid()}")
    phases = {"no_hints": [], "hints": []}
    front.start()
    try:
        names = spec.model_names()
        import numpy as np
        x = [np.random.default_rng(0).standard_normal((spec.batch, spec.seq, hidden))
             .astype(np.float32)]
        run_load(front.endpoint, names, 2 * models * workers, concurrency, False, x, seed=99)
        for r in range(repeats):
            for mode, hint in (("no_hints", False), ("hints", True)):
                phases[mode].append(run_load(front.endpoint, names, requests, concurrency, hint,
                                             x, seed=r))
        counters = dict(front.counters)
    finally:
        front.close()

    def summary(runs):
        return {"rps": _median([x["rps"] for x in runs]),
                "p50_seconds": _median([x["p50_seconds"] for x in runs]),
                "p99_seconds": _median([x["p99_seconds"] for x in runs]),
                "errors": sum(sum(x["errors"].values()) for x in runs), "runs": runs}

    off, on = summary(phases["no_hints"]), summary(phases["hints"])

    def ratio(a, b):
        return a / b if a and b else None

    return {"kind": "serve", "workers": workers, "models": models, "hidden": hidden,
            "layers": layers, "model_bytes": model_bytes, "device_budget_bytes": spec.device_budget(),
            "requests_per_phase": requests, "repeats": repeats, "concurrency": concurrency,
            "no_hints": off, "hints": on,
            "ratios": {"rps": ratio(on["rps"], off["rps"]),
                       "p50": ratio(on["p50_seconds"], off["p50_seconds"]),
                       "p99": ratio(on["p99_seconds"], off["p99_seconds"])},
            "front": counters, "ok": off["errors"] == 0 and on["errors"] == 0}
