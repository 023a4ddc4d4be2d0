"""What the `bench serve` sections share (prefetchd.bench.serve, .serve_shared): starting
and closing fronts at once, one progress line per phase, medians and ratios of the runs."""
import sys
import threading


def start_all(fronts):
    """Start every front at once (their workers import MindSpore in parallel)."""
    errors = {}

    def start(role, front):
        try:
            front.start()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the others
            errors[role] = e
    threads = [threading.Thread(target=start, args=item) for item in fronts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        role, error = next(iter(errors.items()))
        raise RuntimeError(f"bench serve: the {role} front did not start: {error}") from error


def close_all(fronts, timeout=30):
    """Close every front at once (each waits for its workers to exit)."""
    closing = [threading.Thread(target=f.close, args=(timeout,)) for f in fronts.values()]
    for t in closing:
        t.start()
    for t in closing:
        t.join()


def progress(what, run):
    """One line per phase on stderr: a long run shows where it is."""
    print(f"bench serve: {what}: {run['completed']}/{run['requests']} in {run['seconds']:.2f}s, "
          f"{run['rps']:.1f} req/s, batch {run['mean_batch_size'] or 0:.1f}", file=sys.stderr,
          flush=True)
    return run


def median(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def ratio(a, b):
    return a / b if a and b else None


def summarize(runs):
    """One phase's closed-loop runs (prefetchd.bench.serve_load): medians of requests/s
    and latency, the mean batch, and the totals."""
    return {"rps": median([r["rps"] for r in runs]),
            "p50_seconds": median([r["p50_seconds"] for r in runs]),
            "p99_seconds": median([r["p99_seconds"] for r in runs]),
            "mean_batch_size": median([r["mean_batch_size"] for r in runs]),
            "requests": sum(r["requests"] for r in runs),
            "completed": sum(r["completed"] for r in runs),
            "errors": sum(sum(r["errors"].values()) for r in runs), "runs": runs}
