"""What the `bench serve` sections share (prefetchd.bench.serve, .serve_shared): starting
fronts at once, one progress line per phase, medians and ratios of the runs."""
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
