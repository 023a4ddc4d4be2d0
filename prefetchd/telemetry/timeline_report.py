"""Reading a timeline back: its spans per track, where the time went, a table and a plot.

    print(summarize(tl))           # tl: a Timeline, a trace dict, or the path of a written trace
    breakdown(tl, since_ns=t0)     # {"wall", "compute", "stall", "tracks", "copy", ...} in seconds
    plot(tl, "run.png")            # needs the `plot` extra (matplotlib)
"""
import json
import os

from .output_files import write_atomically
from .timeline import COMPUTE, COPY_TRACKS, SCHEDULER, TRACKS, Timeline

__all__ = ["breakdown", "plot", "require_plot", "spans", "summarize"]


def spans(source):
    """{track: [(start_ns, end_ns, name, args), ...] sorted by start} of "X" events.

    source: a Timeline, a trace dict (`to_json()`), or the path of a written trace.
    """
    out = {t: [] for t in TRACKS}
    if isinstance(source, Timeline):
        for ph, tid, name, ts, extra, args in source.events():
            if ph == "X":
                out[TRACKS[tid]].append((ts, ts + extra, name, args or {}))
    else:
        doc = source
        if isinstance(source, (str, os.PathLike)):
            with open(source) as f:
                doc = json.load(f)
        events = doc["traceEvents"]
        origin = doc.get("otherData", {}).get("origin_ns", 0)
        names = {e["tid"]: e["args"]["name"] for e in events
                 if e.get("ph") == "M" and e.get("name") == "thread_name"}
        for e in events:
            if e.get("ph") == "X":
                start = origin + round(e["ts"] * 1000)
                out.setdefault(names.get(e["tid"], str(e["tid"])), []).append(
                    (start, start + round(e.get("dur", 0) * 1000), e["name"], e.get("args", {})))
    for track in out.values():
        track.sort()
    return out


def _union(intervals):
    """Merged, sorted [(start, end)] covering the same time as `intervals`."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            if end > merged[-1][1]:
                merged[-1][1] = end
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def _length(union):
    return sum(e - s for s, e in union)


def _overlap(a, b):
    """Total time two merged interval lists share."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def breakdown(source, since_ns=None):
    """Where the time went, in seconds: {"wall", "compute", "stall", "tracks": {track:
    {"busy", "spans", "bytes"}}, "copy", "copy_overlapping_compute"} (busy = union of spans).

    since_ns: count only time after this instant (spans clipped to it; a transfer
    that ended after it counts its bytes) -- e.g. the steady passes after the first.
    """
    by_track = spans(source)
    if since_ns is not None:
        by_track = {t: [(max(s, since_ns), e, n, a) for s, e, n, a in v if e > since_ns]
                    for t, v in by_track.items()}
    every = [(s, e) for track in by_track.values() for s, e, _, _ in track]
    wall = (max(e for _, e in every) - min(s for s, _ in every)) if every else 0
    unions = {t: _union((s, e) for s, e, name, _ in v if not (t == SCHEDULER and name != "stall"))
              for t, v in by_track.items()}
    compute = unions.get(COMPUTE, [])
    copy = _union(iv for t in COPY_TRACKS for iv in unions.get(t, []))
    tracks = {}
    for t, v in by_track.items():
        if t in (COMPUTE, SCHEDULER):
            continue
        tracks[t] = {"busy": _length(unions[t]) / 1e9, "spans": len(v),
                     "bytes": sum(int(a.get("bytes", 0)) for *_, a in v)}
    return {"wall": wall / 1e9, "compute": _length(compute) / 1e9,
            "stall": _length(unions.get(SCHEDULER, [])) / 1e9,
            "compute_spans": len(by_track.get(COMPUTE, [])), "tracks": tracks,
            "copy": _length(copy) / 1e9, "copy_overlapping_compute": _overlap(copy, compute) / 1e9}


def summarize(source, since_ns=None, what="first to last event"):
    """`breakdown(source, since_ns)` as a small table string; `what` names the span of time."""
    b = breakdown(source, since_ns)
    wall = b["wall"] or 1e-12

    def row(what, seconds, extra=""):
        return f"  {what:<20} {seconds:>9.3f} s {seconds / wall:>6.1%}  {extra}".rstrip()

    lines = [f"where the time went (wall {b['wall']:.3f} s, {what}; busy time per track)",
             row("compute", b["compute"], f"{b['compute_spans']} unit runs"),
             row("stall", b["stall"], "compute waiting for weights")]
    for track, t in b["tracks"].items():
        if t["spans"]:
            rate = t["bytes"] / t["busy"] / 1e6 if t["busy"] else 0.0
            lines.append(row(track, t["busy"], f"{t['spans']} transfers, {t['bytes'] / 2**20:,.1f} MiB"
                             f" at {rate:,.0f} MB/s"))
    if b["copy"]:
        lines.append(f"  copy overlapping compute: {b['copy_overlapping_compute']:.3f} s of "
                     f"{b['copy']:.3f} s copying ({b['copy_overlapping_compute'] / b['copy']:.0%})")
    return "\n".join(lines)


def require_plot():
    """Raise ImportError naming the `plot` extra unless matplotlib can be imported."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError("drawing a timeline needs matplotlib, which is not installed: "
                          "pip install 'prefetchd[plot]'") from None
    return matplotlib


def plot(source, path):
    """Draw the timeline's tracks to a PNG at `path` (needs the `plot` extra: matplotlib)."""
    matplotlib = require_plot()
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by_track = spans(source)
    every = [s for v in by_track.values() for s, *_ in v]
    origin = min(every) if every else 0
    rows = [t for t in TRACKS if by_track.get(t)]
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * max(1, len(rows))))
    for y, track in enumerate(rows):
        bars = [((s - origin) / 1e9, max((e - s) / 1e9, 1e-6)) for s, e, name, _ in by_track[track]
                if not (track == SCHEDULER and name != "stall")]
        ax.broken_barh(bars, (y - 0.4, 0.8), color=f"C{TRACKS.index(track)}")
    ax.set_yticks(range(len(rows)), [("stall" if t == SCHEDULER else t) for t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("prefetchd timeline")
    fig.tight_layout()
    try:
        return write_atomically(path, lambda f: fig.savefig(f, dpi=100, format="png"))
    finally:
        plt.close(fig)
