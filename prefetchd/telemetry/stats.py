"""Counters and fixed-bucket histograms the scheduler updates on completions.

Plain numbers and lists, mutated only under the daemon's lock, so that a
metrics scrape is one consistent copy (`snapshot()`) and the hot path creates
no Python objects per request.
"""
from bisect import bisect_left
from dataclasses import dataclass, field

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# Transfers range from a few KiB (biases) to GiB (embedding tables).
SIZE_BUCKETS = (4 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB,
                256 * MiB, 1 * GiB, 4 * GiB)
# 10 us (host copy of a small tensor) to 10 s (a GiB from a slow disk).
SECONDS_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

DIRECTIONS = ("load", "store", "h2d", "d2h")
REQUEST_OPS = ("prefetch", "evict", "pin", "flush", "fetch")
# "refused": the caller asked what the tensor's state forbids (an evict of a pinned one), its
# to resolve; "failed": the daemon could not do it (budget, storage, shutdown), which alerts watch.
OUTCOMES = ("hit", "miss", "issued", "failed", "refused", "cancelled")
EVICTION_REASONS = ("watermark", "explicit", "shutdown")


class Histogram:
    """Cumulative-on-read histogram: `counts[i]` counts values <= buckets[i]; the last slot is +Inf."""

    __slots__ = ("buckets", "counts", "sum", "count")

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value):
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self):
        h = Histogram(self.buckets)
        h.counts, h.sum, h.count = list(self.counts), self.sum, self.count
        return h

    def cumulative(self):
        """[(upper_bound, cumulative_count)], ending with (+inf, count) — Prometheus' shape."""
        out, running = [], 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            out.append((bound, running))
        return out

    def quantile(self, q):
        """Upper bucket bound holding the q-quantile (what histogram_quantile would bracket)."""
        if not self.count:
            return 0.0
        target, running = q * self.count, 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            if running >= target:
                return bound
        return float("inf")


@dataclass
class Stats:
    transfer_bytes: dict = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0))
    transfer_seconds: dict = field(default_factory=lambda: dict.fromkeys(DIRECTIONS, 0.0))
    transfer_size: dict = field(default_factory=lambda: {d: Histogram(SIZE_BUCKETS) for d in DIRECTIONS})
    transfer_duration: dict = field(
        default_factory=lambda: {d: Histogram(SECONDS_BUCKETS) for d in DIRECTIONS})
    requests: dict = field(
        default_factory=lambda: {(o, r): 0 for o in REQUEST_OPS for r in OUTCOMES})
    evictions: dict = field(default_factory=lambda: dict.fromkeys(EVICTION_REASONS, 0))
    queue_wait: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    stall: Histogram = field(default_factory=lambda: Histogram(SECONDS_BUCKETS))
    trace_resyncs: int = 0
    checksum_failures: int = 0
    io_errors: dict = field(default_factory=lambda: {"read": 0, "write": 0})
    writebacks: int = 0
    fences: int = 0
    loads_from: dict = field(default_factory=lambda: {"host": 0, "remote": 0})      # device loads by source
    load_bytes_from: dict = field(default_factory=lambda: {"host": 0, "remote": 0})
    host_drops: int = 0      # cached host replicas dropped for room (free: the remote copy is the truth)
    rebinds: int = 0         # framework tensors pointed at new storage after registration
    reclaims: int = 0        # dropped replicas taken back before their pages left (no I/O)
    compute_writes: int = 0  # resident replicas found written in place by compute (then written back)
    # Host -> device on the cpu backend moves pages, not bytes (core/lending.py):
    moved_bytes: int = 0     # loaded into the device tier with no copy: pages moved or unparked
    copied_bytes: int = 0    # loaded into the device tier by a copy (memcpy / DMA)
    returned_bytes: int = 0  # given back to the host tier when the device replica was dropped
    parked_bytes: int = 0    # of those, left under the home PROT_NONE (no page move)
    unparked_bytes: int = 0  # of moved_bytes, made readable again under the home (no page move)
    page_moves: int = 0      # mremap moves: host fills and returns, home attaches and detaches
    page_protects: int = 0   # permission changes instead of moves: parks and unparks
    page_move_seconds: float = 0.0   # wall time in both (the caller's side of their TLB shootdowns)

    def count(self, op, outcome):
        """Count one request outcome (registrations are not counted as requests)."""
        if op != "register":
            self.requests[op, outcome] = self.requests.get((op, outcome), 0) + 1

    def record_transfer(self, direction, nbytes, seconds):
        self.transfer_bytes[direction] += nbytes
        self.transfer_seconds[direction] += seconds
        self.transfer_size[direction].observe(nbytes)
        self.transfer_duration[direction].observe(seconds)

    def snapshot(self):
        return Stats(
            transfer_bytes=dict(self.transfer_bytes),
            transfer_seconds=dict(self.transfer_seconds),
            transfer_size={k: h.copy() for k, h in self.transfer_size.items()},
            transfer_duration={k: h.copy() for k, h in self.transfer_duration.items()},
            requests=dict(self.requests),
            evictions=dict(self.evictions),
            queue_wait=self.queue_wait.copy(),
            stall=self.stall.copy(),
            trace_resyncs=self.trace_resyncs,
            checksum_failures=self.checksum_failures,
            io_errors=dict(self.io_errors),
            writebacks=self.writebacks,
            fences=self.fences,
            loads_from=dict(self.loads_from),
            load_bytes_from=dict(self.load_bytes_from),
            host_drops=self.host_drops,
            rebinds=self.rebinds,
            reclaims=self.reclaims,
            compute_writes=self.compute_writes,
            moved_bytes=self.moved_bytes,
            copied_bytes=self.copied_bytes,
            returned_bytes=self.returned_bytes,
            parked_bytes=self.parked_bytes,
            unparked_bytes=self.unparked_bytes,
            page_moves=self.page_moves,
            page_protects=self.page_protects,
            page_move_seconds=self.page_move_seconds,
        )
