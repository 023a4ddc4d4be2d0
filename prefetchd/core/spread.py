"""Which steps of a cyclic trace a host cache too small for it keeps: spread evenly.

On a cyclic trace in which each tensor is used once per pass, every set of cached
tensors of the same size hits the same number of times, so Belady's hit count does
not care which steps stay in RAM. Overlap does. Kept as one run (the suffix that
LRU leaves after the first pass), the disk is read for the other run back to back
while compute waits, and then sits idle while the cached run computes. Kept
evenly spread, every disk read has cached steps around it whose compute it hides
behind, and the disk stays busy the whole pass (docs/performance.md, "Spread host
cache").

`spread` is error diffusion over the steps in trace order (Bresenham's line): each
step earns `capacity / total` of its bytes as credit and is kept when the credit
covers it, so kept bytes stay within `capacity` and within one step of the even
share at every point of the trace. Pure: the host cache (core/hostcache.py) and
the cost model (prefetchd/cost/model.py) both call it.
"""


def spread(sizes, capacity):
    """Indices of the steps to keep, given each step's bytes in trace order and the
    bytes the cache may hold; every index when they all fit."""
    total = sum(sizes)
    if total <= capacity:
        return list(range(len(sizes)))
    # In integers (credit scaled by `total`), so equal steps come out exactly every nth.
    kept, credit, room = [], 0, capacity
    for i, size in enumerate(sizes):
        credit += capacity * size
        if size * total <= credit and size <= room:
            kept.append(i)
            credit -= size * total
            room -= size
    return kept
