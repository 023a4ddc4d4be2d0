"""prefetchd.telemetry.stats.Stats <-> JSON, for the `stats` op and metrics of remote daemons."""
import math
from dataclasses import fields


def jsonable(obj):
    """obj with NaN/inf as None, tuples as lists and unknown objects as str."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    return str(obj)


def stats_to_json(stats):
    """A Stats as JSON: histograms as {buckets, counts, sum, count},
    tuple-keyed counters as nested {op: {outcome: n}}."""
    return {f.name: _stat_value(getattr(stats, f.name)) for f in fields(stats)}


def stats_from_json(doc):
    """The inverse of stats_to_json: a prefetchd.telemetry.stats.Stats (for metrics of a remote daemon)."""
    from ..telemetry.stats import Histogram, Stats

    def hist(v):
        h = Histogram(v["buckets"])
        h.counts, h.sum, h.count = list(v["counts"]), v["sum"], v["count"]
        return h

    stats = Stats()
    for f in fields(stats):
        if f.name not in doc:
            continue
        current, value = getattr(stats, f.name), doc[f.name]
        if isinstance(current, Histogram):
            value = hist(value)
        elif isinstance(current, dict) and current:
            sample = next(iter(current))
            if isinstance(sample, tuple):
                value = {(a, b): n for a, inner in value.items() for b, n in inner.items()}
            elif isinstance(current[sample], Histogram):
                value = {k: hist(v) for k, v in value.items()}
            else:
                value = dict(value)
        setattr(stats, f.name, value)
    return stats


def _stat_value(value):
    if hasattr(value, "buckets") and hasattr(value, "counts"):
        return {"buckets": list(value.buckets), "counts": list(value.counts),
                "sum": value.sum, "count": value.count}
    if isinstance(value, dict):
        nested = {}
        for k, v in value.items():
            if isinstance(k, tuple):
                node = nested
                for part in k[:-1]:
                    node = node.setdefault(str(part), {})
                node[str(k[-1])] = _stat_value(v)
            else:
                nested[str(k)] = _stat_value(v)
        return nested
    return jsonable(value)
