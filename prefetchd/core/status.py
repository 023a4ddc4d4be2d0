"""The daemon's status document and its tensors' descriptions (docs/daemon-api.md)."""
from . import patterns
from .records import State


def describe(config, registry, core, *, closed, running):
    """status() of a daemon; `core` is None before start()."""
    states = dict.fromkeys((s.value for s in State), 0)
    pinned = pinned_bytes = cached = cached_bytes = lent_bytes = parked_bytes = 0
    for rec in registry:
        states[rec.state.value] += 1
        if rec.pins:
            pinned += 1
            pinned_bytes += rec.nbytes
        if rec.host_cached:
            cached += 1
            cached_bytes += rec.nbytes
        if rec.host_lent:
            lent_bytes += rec.nbytes
        if rec.host_parked or rec.mapping_parked:
            parked_bytes += rec.nbytes
    be = core.backend if core else None
    used = be.device_used() if be else 0
    cap = config.device_budget
    memory = core.memory if core else None
    return {
        "name": config.name,
        # this daemon's place in a sharded job (prefetchd/ranks.py), or None
        "rank": (None if config.rank is None
                 else {"rank": config.rank, "world_size": config.world_size}),
        "closed": closed,
        "backend": config.backend,
        "io_engine": be.io_engine if be else None,
        "device": {"capacity": cap, "used": used, "peak": memory.peak if memory else 0,
                   "high_watermark": memory.in_force[0] if memory else config.high_watermark,
                   "low_watermark": memory.in_force[1] if memory else config.low_watermark,
                   "usage_ratio": used / cap if cap else 0.0},
        # cached: host replicas kept as a cache of the remote tier (dropped for free)
        # lent_bytes: host blocks (counted in `used`) whose pages are under a device replica;
        # parked_bytes: pages of the host tier (or a shared tier's mappings) waiting under
        # homes of tensors not resident, unreadable (core/lending.py)
        "host": {"budget": config.host_budget, "used": be.host_used() if be else 0,
                 "cached": cached, "cached_bytes": cached_bytes, "lent_bytes": lent_bytes,
                 "parked_bytes": parked_bytes},
        "page_moves": _page_moves(core.stats if core else None),
        # the shared host tier this daemon loads through (docs/shared-host.md), or None
        "shared_host": be.shared.describe() if getattr(be, "shared", None) is not None else None,
        "remote": {"bytes": be.store_bytes() if be and running else 0},
        "loads_from": dict(core.stats.loads_from) if core else {"host": 0, "remote": 0},
        "load_bytes_from": dict(core.stats.load_bytes_from) if core else {"host": 0, "remote": 0},
        "queue_depth": len(core.inbox) + len(core.loads.queue) if core else 0,
        "in_flight": len(core.transfers) if core else 0,
        "pinned": pinned, "pinned_bytes": pinned_bytes,
        "tensors": len(registry), "states": states,
    }


def _page_moves(stats):
    """How bytes reached the device tier: with no copy (pages moved, or unparked under the
    home) or copied, and the time spent in page moves and permission changes
    (core/lending.py). Cumulative since start()."""
    if stats is None:
        return {"moved_bytes": 0, "copied_bytes": 0, "returned_bytes": 0, "parked_bytes": 0,
                "unparked_bytes": 0, "moves": 0, "protects": 0, "seconds": 0.0}
    return {"moved_bytes": stats.moved_bytes, "copied_bytes": stats.copied_bytes,
            "returned_bytes": stats.returned_bytes, "parked_bytes": stats.parked_bytes,
            "unparked_bytes": stats.unparked_bytes, "moves": stats.page_moves,
            "protects": stats.page_protects, "seconds": stats.page_move_seconds}


def describe_tensors(lock, registry, core, pattern):
    """describe() of every tensor whose name matches the glob `pattern` (core/patterns.py),
    each asked first whether compute wrote it in place (cpu): the scheduler looks only when
    it drops a replica, and `dirty` said False for a tensor a kernel had written."""
    glob = patterns.compile_glob(pattern)        # a bad or too long pattern raises here
    with lock:
        records = list(registry.records.items())
    # Matched on the snapshot, without the lock: the scheduler never waits for a pattern.
    matched = [r for name, r in records if glob.match(name)]
    with lock:
        live = [r for r in matched if registry.records.get(r.name) is r]
        for r in live:
            core.note_writes(r)
        return [r.describe() for r in live]
