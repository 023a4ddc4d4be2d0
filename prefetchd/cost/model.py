"""A cost model for one offloaded model: how far ahead to prefetch, what the host
cache keeps, and how long a pass takes (in the spirit of FlexGen's).

    inputs = measure(unit_bytes, dispatch_ns, fence_ns, stats=daemon.stats, ...)   # after a first pass
    p = plan(inputs)                  # a Schedule: p.lookahead, p.host_cached, p.pass_seconds, ...
    p = plan(inputs, lookahead=3)     # the same for a given lookahead (clamped to the budget)

Pure Python, no MindSpore: everything it needs is numbers the layer hooks and
the daemon already record.

The pipeline it simulates is the one prefetchd/hooks/offload.py drives. One copy
stream moves units in trace order (a disk read, or a host->device copy, or
both for a disk read that fills the host cache). Compute runs units in order
on the framework's queue. Python dispatches unit j's kernels as soon as j is
resident (PyNative runs asynchronously), so the pre-hook of unit j — which
prefetches units j+1..j+k — fires when unit j-1 became resident, usually well
before j-1 finished computing. A load also needs device room: with `slots`
units fitting under the high watermark beside the root, unit i waits for unit
i-slots to finish computing (its memory is reused after its compute fence).
Where copies are memcpys on compute's own cores (the cpu backend), compute
stretches by copy_contention times the pass's copy seconds (and the CPU
checksums of its disk reads, at checksum_rate): a kernel spread
over every core with a barrier at its end waits for its slowest thread, so a
copy holding one core holds back the whole kernel (copy_contention = 1). An
accelerator copies by DMA beside compute: copy_contention = 0.

A pass is timed the way `prefetchd bench model` times it: from the call until
its outputs are computed *and* the prefetches it issued for the next pass have
landed; it starts with the first k units already on the device (prefetched by
the previous pass's post-hook). The first pass records the trace, so it loads
on demand (k = 0 for its own units).

Host cache (core/hostcache.py): the first pass has no trace, so the cache is
LRU and admits every unit that fits. From then on, where the budget cannot hold
the model, it keeps units spread evenly along the trace (core/spread.py): those
copy from RAM every later pass, the others are read from disk straight into the
device block, each between cached units whose compute hides it.
"""
import statistics
from dataclasses import dataclass, field

from ..core.spread import spread

ALIGN = 4096                 # host and device blocks are reserved in 4 KiB pages (backend.block_bytes)
TOLERANCE = 0.01             # lookaheads within 1% of the best pass time count as hiding the I/O


def block_bytes(nbytes):
    return -(-int(nbytes) // ALIGN) * ALIGN


@dataclass(frozen=True)
class Inputs:
    """What the plan needs; units in trace order, root excluded.

    disk_rate / h2d_rate: bytes per second of the store's checksummed reads
    and of host->device copies. compute_seconds: each unit's compute alone
    (stalls excluded), e.g. from `compute_seconds_from_fences`.
    tier: where weights live between uses, "remote" (store, host cache in
    front) or "host" (RAM; never read from disk).
    copy_contention: seconds of compute lost per second of host->device copying:
    0 where copies run beside compute (an accelerator's DMA engine); 1 where
    they are memcpys on the cores compute runs on (the cpu backend, whose
    kernels run on every core and wait for the slowest, see the module docstring).
    copy_cpu_rate: bytes per CPU-second of that copying (a memcpy measured
    alone); 0: h2d_rate, i.e. the copy stream's rate is all CPU work. Apart
    from h2d_rate where the stream's rate was measured with compute beside it
    (the hooks' later passes): that rate is already slowed by compute, and
    charging compute for copies at it would count the contention twice.
    """
    unit_bytes: tuple
    compute_seconds: tuple
    disk_rate: float
    h2d_rate: float
    high_watermark: int
    host_budget: int
    root_bytes: int = 0
    root_seconds: float = 0.0        # compute outside the units (embeddings, head)
    tier: str = "remote"
    dispatch_ahead: bool = True      # False: the framework runs ops synchronously
    copy_contention: float = 0.0
    checksum_rate: float = 0.0       # bytes/s of the CRC32C verifying each disk read on the CPU; 0: free
    copy_cpu_rate: float = 0.0       # bytes per CPU-second of a host->device copy; 0: h2d_rate

    def __post_init__(self):
        object.__setattr__(self, "unit_bytes", tuple(int(b) for b in self.unit_bytes))
        object.__setattr__(self, "compute_seconds", tuple(float(c) for c in self.compute_seconds))
        if len(self.unit_bytes) != len(self.compute_seconds):
            raise ValueError(f"{len(self.unit_bytes)} unit sizes but {len(self.compute_seconds)} compute times")
        if any(b < 0 for b in self.unit_bytes) or any(c < 0 for c in self.compute_seconds):
            raise ValueError("unit bytes and compute seconds must be >= 0")
        if self.tier not in ("remote", "host"):
            raise ValueError(f"tier must be 'remote' or 'host', not {self.tier!r}")
        if not self.h2d_rate or self.h2d_rate <= 0:
            raise ValueError(f"h2d_rate must be > 0 bytes/s, not {self.h2d_rate!r}")
        if self.tier == "remote" and (not self.disk_rate or self.disk_rate <= 0):
            raise ValueError(f"disk_rate must be > 0 bytes/s for the remote tier, not {self.disk_rate!r}")
        if not self.checksum_rate >= 0:
            raise ValueError(f"checksum_rate must be >= 0 bytes/s, not {self.checksum_rate!r}")
        if not self.copy_cpu_rate >= 0:
            raise ValueError(f"copy_cpu_rate must be >= 0 bytes/s, not {self.copy_cpu_rate!r}")
        if not 0 <= self.copy_contention <= 1:
            raise ValueError(f"copy_contention must be in [0, 1], not {self.copy_contention!r}")
        if self.high_watermark <= 0 or self.host_budget < 0 or self.root_bytes < 0:
            raise ValueError("high_watermark must be > 0, host_budget and root_bytes >= 0")


@dataclass(frozen=True)
class Schedule:
    """What the cost model chose for a model and what it predicts: how far ahead to prefetch,
    which units the host cache keeps, and the pass times that follow (seconds)."""
    lookahead: int               # units prefetched ahead
    max_lookahead: int           # what the device budget allows beside the root and the unit computing
    clamped: bool                # a requested lookahead was above max_lookahead
    host_cached: tuple           # unit indices that copy from host RAM after the first pass
    first_pass_seconds: float
    pass_seconds: float          # a steady-state pass
    stall_seconds: float         # of a steady pass: compute waiting for weights
    compute_seconds: float       # sum over units and root, no I/O
    io_seconds: float            # copy-stream busy time of a steady pass
    disk_seconds: float          # of which disk reads
    bound: str                   # "compute" or "io"
    by_lookahead: dict = field(default_factory=dict)   # k -> steady pass seconds, k = 0..max

    def as_dict(self):
        return {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v)
                for k, v in self.__dict__.items()}


# ---------------------------------------------------------------------- the model
def slots(inputs):
    """Units that fit on the device at once beside the root (largest unit as the measure)."""
    if not inputs.unit_bytes:
        return 0
    largest = max(block_bytes(b) for b in inputs.unit_bytes) or ALIGN
    return max(0, (inputs.high_watermark - block_bytes(inputs.root_bytes)) // largest)


def max_lookahead(inputs):
    # The hooks prefetch only what fits beside the pinned root and the unit computing.
    return max(0, min(len(inputs.unit_bytes) - 1, slots(inputs) - 1))


def fits_on_device(inputs):
    total = block_bytes(inputs.root_bytes) + sum(block_bytes(b) for b in inputs.unit_bytes)
    return total <= inputs.high_watermark


def host_cached(inputs):
    """Unit indices whose tensors stay in host RAM after the first pass: the steps the
    host cache spreads evenly along the trace (core/spread.py; the root is its step 0),
    every unit where the budget holds them all."""
    n = len(inputs.unit_bytes)
    if inputs.tier == "host":
        return tuple(range(n))
    sizes = [block_bytes(inputs.root_bytes)] + [block_bytes(b) for b in inputs.unit_bytes]
    return tuple(i - 1 for i in spread(sizes, inputs.host_budget) if i > 0)


def moves(inputs, first_pass):
    """Per unit: (disk seconds, host->device copy seconds) to bring it to the device in
    the first or a later pass. The copy stream is busy for their sum; the copies are
    also CPU work where copy_contention > 0."""
    cached = set(host_cached(inputs))
    out = []
    for i, b in enumerate(inputs.unit_bytes):
        disk, copy = b / inputs.disk_rate if inputs.disk_rate else 0.0, b / inputs.h2d_rate
        if inputs.tier == "host":
            out.append((0.0, copy))
        elif first_pass:
            # From disk; through a new host replica (disk read + copy) if the cache admits it.
            # LRU admits every unit that fits the budget at all.
            out.append((disk, copy if block_bytes(b) <= inputs.host_budget else 0.0))
        else:
            out.append((0.0, copy) if i in cached else (disk, 0.0))
    return out


def cpu_seconds(inputs, unit_moves):
    """Seconds of CPU work that `moves` do on the host: the host->device memcpys, and the
    checksums of the disk reads (a read itself is DMA). Where copy_contention > 0 they
    are taken from compute."""
    seconds = sum(copy for _, copy in unit_moves)
    if inputs.copy_cpu_rate:
        seconds *= inputs.h2d_rate / inputs.copy_cpu_rate
    if inputs.checksum_rate and inputs.disk_rate:
        seconds += sum(disk for disk, _ in unit_moves) * inputs.disk_rate / inputs.checksum_rate
    return seconds


def shared_compute(inputs, copies):
    """Per-unit compute seconds and root seconds, stretched by copy_contention x
    `copies` seconds of CPU work on compute's cores (cpu_seconds), spread in proportion to each
    unit's compute."""
    c, root = list(inputs.compute_seconds), inputs.root_seconds
    if not inputs.copy_contention or not copies:
        return c, root
    stolen, total = copies * inputs.copy_contention, sum(c) + root
    if total <= 0:
        return c, root + stolen
    scale = 1.0 + stolen / total
    return [x * scale for x in c], root * scale


def simulate(inputs, k, io, *, warm, k_next=None, io_next=None, copies=0.0):
    """(pass seconds, stall seconds) of one pass; see the module docstring.

    k: lookahead while this pass runs; warm: its first k units are already on the
    device; k_next / io_next: the prefetches its post-hook issues for the next pass;
    copies: CPU seconds of the pass's moves (cpu_seconds, shared_compute).
    """
    n = len(io)
    c, root_seconds = shared_compute(inputs, copies)
    k_next = k if k_next is None else k_next
    io_next = io if io_next is None else io_next
    s = max(1, slots(inputs))
    ready, end = [0.0] * n, [0.0] * n
    stream = compute = stall = 0.0

    def dispatched(j):       # when Python reaches unit j's pre-hook
        if j <= 0:
            return 0.0
        return ready[j - 1] if inputs.dispatch_ahead else end[j - 1]

    for i in range(n):
        if warm and i < k:
            ready[i] = 0.0
        else:
            issue = dispatched(max(0, i - k))
            if i - s >= 0:
                issue = max(issue, end[i - s])     # device room: unit i-s's memory after its fence
            stream = max(stream, issue) + io[i]
            ready[i] = stream
        start = max(compute, ready[i])
        stall += start - max(compute, dispatched(i))
        compute = start + c[i]
        end[i] = compute
    # The post-hook (after the last unit was dispatched) prefetches the next pass's first units.
    last = dispatched(n)
    for j in range(min(k_next, n)):
        issue = last
        if n + j - s < n and n + j - s >= 0:
            issue = max(issue, end[n + j - s])
        stream = max(stream, issue) + io_next[j]
    total = max(compute + root_seconds, stream)
    return total, stall


def plan(inputs, lookahead=None):
    """The Plan for `inputs`: the given lookahead (clamped to the budget), or the
    smallest that hides I/O (at least 1 where there is I/O to hide: lookahead 0
    relies on the framework dispatching ahead, which a host sync in a unit defeats)."""
    n = len(inputs.unit_bytes)
    k_max = max_lookahead(inputs)
    compute_total = sum(inputs.compute_seconds) + inputs.root_seconds
    first_moves = moves(inputs, first_pass=True)
    # Everything that fits stays resident after the first pass: nothing moves.
    steady_moves = [(0.0, 0.0)] * n if fits_on_device(inputs) else moves(inputs, first_pass=False)
    first_io = [disk + copy for disk, copy in first_moves]
    steady_io = [disk + copy for disk, copy in steady_moves]
    first_copies = cpu_seconds(inputs, first_moves)
    steady_copies = cpu_seconds(inputs, steady_moves)
    by_k = {k: simulate(inputs, k, steady_io, warm=True, copies=steady_copies)[0] for k in range(k_max + 1)}
    clamped = False
    if lookahead is None:
        best = min(by_k.values()) if by_k else 0.0
        floor = min(1, k_max) if any(steady_io) else 0
        k = next((k for k in sorted(by_k) if k >= floor and by_k[k] <= best * (1 + TOLERANCE)), k_max)
    else:
        if int(lookahead) < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        k = min(int(lookahead), k_max)
        clamped = int(lookahead) > k_max
    steady, stall = simulate(inputs, k, steady_io, warm=True, copies=steady_copies)
    first, _ = simulate(inputs, 0, first_io, warm=False, k_next=k, io_next=steady_io, copies=first_copies)
    io_total = sum(steady_io)
    disk = sum(disk for disk, _ in steady_moves)
    return Schedule(lookahead=k, max_lookahead=k_max, clamped=clamped, host_cached=host_cached(inputs),
                first_pass_seconds=first, pass_seconds=steady, stall_seconds=stall,
                compute_seconds=compute_total, io_seconds=io_total, disk_seconds=disk,
                bound="io" if io_total > compute_total else "compute", by_lookahead=by_k)


# ---------------------------------------------------------------------- measuring
def rate(nbytes, seconds):
    """Bytes per second, or None if nothing was measured."""
    return nbytes / seconds if nbytes and seconds and seconds > 0 else None


def rates_from_stats(stats, since=None):
    """(disk_rate, h2d_rate) from a daemon's Stats, of the transfers completed since the
    earlier snapshot `since` (all if None); each None if there were none. Disk reads are
    counted as "load" (straight to the device or into the host cache), host->device copies
    as "h2d". Transfers on one copy stream do not overlap, so bytes / summed seconds is the rate."""
    def moved(kind):
        nbytes, seconds = stats.transfer_bytes[kind], stats.transfer_seconds[kind]
        if since is not None:
            nbytes, seconds = nbytes - since.transfer_bytes[kind], seconds - since.transfer_seconds[kind]
        return rate(nbytes, seconds)
    return moved("load"), moved("h2d")


def compute_seconds_from_fences(dispatch_ns, fence_ns):
    """Per-unit compute seconds from when each unit's kernels were dispatched (after
    its weights were resident) and when its compute fence was reached, in run
    order. A unit starts when it was dispatched or when the previous one finished,
    whichever is later, so time spent waiting for weights is not counted as compute."""
    if len(dispatch_ns) != len(fence_ns):
        raise ValueError(f"{len(dispatch_ns)} dispatch times but {len(fence_ns)} fence times")
    out, previous = [], None
    for dispatched, fenced in zip(dispatch_ns, fence_ns):
        start = dispatched if previous is None else max(dispatched, previous)
        out.append(max(0, fenced - start) / 1e9)
        previous = fenced if previous is None else max(previous, fenced)
    return out


def pooled(seconds, kinds, least=3, statistic=statistics.median):
    """Each unit's compute seconds replaced by the median (or `statistic`) over the units
    of its kind (e.g. the same cell types and parameter shapes) where at least `least`
    share it: the same kernels on the same shapes take the same time, and the median
    drops one-off costs that land on one of them in a single timed pass (the framework's
    first call at a shape, a page-fault burst, another process). statistics.fmean keeps
    the kind's sum: right where fences passed together gave one unit its neighbours' time."""
    if len(seconds) != len(kinds):
        raise ValueError(f"{len(seconds)} compute times but {len(kinds)} unit kinds")
    groups = {}
    for s, kind in zip(seconds, kinds):
        groups.setdefault(kind, []).append(s)
    pooled_by_kind = {k: statistic(v) for k, v in groups.items() if len(v) >= least}
    return [pooled_by_kind.get(kind, s) for s, kind in zip(seconds, kinds)]


def measure(unit_bytes, dispatch_ns, fence_ns, *, high_watermark, host_budget, stats=None,
            disk_rate=None, h2d_rate=None, root_bytes=0, root_seconds=0.0, tier="remote", copy_contention=0.0,
            checksum_rate=0.0, copy_cpu_rate=0.0, unit_kinds=None):
    """Inputs from what a first pass recorded: unit bytes in trace order, each unit's
    dispatch and fence times (ns, see FenceClock), and the transfer rates, given or
    taken from the daemon's stats (`daemon.snapshot()[1]`). unit_kinds (one hashable
    per unit, optional): units of one kind get their kind's median compute (`pooled`)."""
    if stats is not None:
        measured_disk, measured_h2d = rates_from_stats(stats)
        disk_rate = disk_rate or measured_disk
        h2d_rate = h2d_rate or measured_h2d
    if tier == "remote" and disk_rate is None:
        raise ValueError("no disk read was measured (no 'load' transfers): pass disk_rate")
    if h2d_rate is None:
        # Every load went disk -> device directly: a copy is at least as fast as that read.
        h2d_rate = disk_rate
    compute = compute_seconds_from_fences(dispatch_ns, fence_ns)
    if unit_kinds is not None:
        compute = pooled(compute, unit_kinds)
    return Inputs(unit_bytes=tuple(unit_bytes), compute_seconds=tuple(compute),
                  disk_rate=disk_rate or 0.0, h2d_rate=h2d_rate, high_watermark=high_watermark,
                  host_budget=host_budget, root_bytes=root_bytes, root_seconds=root_seconds, tier=tier,
                  copy_contention=copy_contention, checksum_rate=checksum_rate, copy_cpu_rate=copy_cpu_rate)
