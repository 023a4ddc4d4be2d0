"""prefetchd.cost.model: the cost model on synthetic inputs (no MindSpore)."""
import sys
import threading
import time

import pytest

from helpers import FakeMarker
from prefetchd.cost import model as P
from prefetchd.cost.fence_clock import FenceClock

MiB = 1 << 20


def inputs(n=8, unit=64 * MiB, compute=0.05, disk=1e9, h2d=4e9, high=None, host=None, **kw):
    return P.Inputs(unit_bytes=[unit] * n, compute_seconds=[compute] * n, disk_rate=disk, h2d_rate=h2d,
                    high_watermark=high if high is not None else 6 * unit,
                    host_budget=host if host is not None else 0, **kw)


def test_no_mindspore_import():
    code = "import sys, prefetchd.cost.model; print('mindspore' in sys.modules)"
    import subprocess
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_compute_bound_gets_lookahead_one():
    # I/O of a unit (16 ms from disk) well under its compute (50 ms): one ahead hides it.
    p = P.plan(inputs(unit=16 * MiB, compute=0.05, high=6 * 16 * MiB))
    assert p.lookahead == 1
    assert p.bound == "compute"
    assert p.pass_seconds == pytest.approx(8 * 0.05, rel=0.1)


def test_io_bound_gets_a_larger_lookahead_than_compute_bound():
    # One expensive unit in four (200 ms), three cheap ones (1 ms); a load is 67 ms. To hide
    # the loads behind the expensive unit, the three after it must load during it.
    n, unit = 16, 64 * MiB
    compute = [0.2 if i % 4 == 0 else 0.001 for i in range(n)]

    def make(dispatch_ahead):
        return P.Inputs(unit_bytes=[unit] * n, compute_seconds=compute, disk_rate=1e9, h2d_rate=4e9,
                        high_watermark=8 * unit, host_budget=0, dispatch_ahead=dispatch_ahead)
    sync = P.plan(make(False))              # ops run synchronously: only the hooks prefetch
    assert sync.bound == "io"
    assert sync.lookahead == 3
    assert sync.by_lookahead[2] > sync.by_lookahead[3] * (1 + P.TOLERANCE)
    assert sync.pass_seconds == pytest.approx(min(sync.by_lookahead.values()))
    # With PyNative's asynchronous dispatch the next unit's pre-hook fires while the
    # expensive one still computes: dispatch itself runs ahead, less lookahead is needed.
    ahead = P.plan(make(True))
    assert ahead.lookahead < sync.lookahead
    assert ahead.pass_seconds <= sync.pass_seconds


def test_io_bound_pass_is_the_copy_stream():
    p = P.plan(inputs(compute=0.001, disk=1e9, host=0))
    disk = 8 * 64 * MiB / 1e9
    assert p.bound == "io"
    assert p.disk_seconds == pytest.approx(disk)
    assert disk <= p.pass_seconds <= disk * 1.1


def test_host_budget_covering_the_model_reads_disk_once():
    inp = inputs(host=8 * 64 * MiB)
    p = P.plan(inp)
    assert p.host_cached == tuple(range(8))
    assert p.disk_seconds == 0.0
    assert p.io_seconds == pytest.approx(8 * 64 * MiB / 4e9)
    # The first pass reads the disk (and fills the cache); later passes only copy.
    assert p.first_pass_seconds > 8 * 64 * MiB / 1e9
    assert p.pass_seconds < p.first_pass_seconds


def test_partial_host_budget_keeps_units_spread_along_the_trace():
    p = P.plan(inputs(host=3 * 64 * MiB + 100))
    assert p.host_cached == (2, 5, 7)        # core/spread.py: 3/8 of each unit's bytes as credit
    assert p.disk_seconds == pytest.approx(5 * 64 * MiB / 1e9)
    # Remote with a host copy of everything is as fast as the host tier.
    full = P.plan(inputs(host=8 * 64 * MiB))
    host = P.plan(inputs(host=8 * 64 * MiB, tier="host"))
    assert full.pass_seconds == pytest.approx(host.pass_seconds)
    # Spread out, the five disk reads (67 ms each) hide behind the compute around them
    # (50 ms a unit); with less compute to hide behind, they show.
    assert p.pass_seconds == pytest.approx(full.pass_seconds)
    fast = P.plan(inputs(host=3 * 64 * MiB + 100, compute=0.01))
    assert fast.pass_seconds > P.plan(inputs(host=8 * 64 * MiB, compute=0.01)).pass_seconds


def test_budget_too_small_for_lookahead_is_clamped():
    inp = inputs(high=3 * 64 * MiB + 4096)        # root 0: three units fit -> two ahead at most
    assert P.max_lookahead(inp) == 2
    p = P.plan(inp, lookahead=5)
    assert p.lookahead == 2 and p.clamped
    assert P.plan(inp, lookahead=1).clamped is False
    tight = inputs(high=64 * MiB + 4096)           # room for the unit computing only
    assert P.plan(tight).lookahead == 0
    with_root = inputs(high=3 * 64 * MiB + 4096, root_bytes=64 * MiB)
    assert P.max_lookahead(with_root) == 1


def test_model_that_fits_the_device_has_no_steady_io():
    p = P.plan(inputs(high=9 * 64 * MiB))
    assert p.io_seconds == 0 and p.disk_seconds == 0
    assert p.pass_seconds == pytest.approx(8 * 0.05)


def test_lookahead_zero_without_async_dispatch_serialises_io_and_compute():
    sync = inputs(compute=0.05, dispatch_ahead=False)
    on_demand = P.simulate(sync, 0, [0.064] * 8, warm=False)[0]
    assert on_demand == pytest.approx(8 * (0.05 + 0.064))
    ahead = P.simulate(inputs(compute=0.05), 0, [0.064] * 8, warm=False)[0]
    assert ahead < on_demand


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="unit sizes"):
        P.Inputs(unit_bytes=[1, 2], compute_seconds=[1.0], disk_rate=1, h2d_rate=1, high_watermark=1,
                 host_budget=0)
    with pytest.raises(ValueError, match="disk_rate"):
        inputs(disk=0)
    inputs(disk=None, tier="host")                # the host tier never reads the disk
    with pytest.raises(ValueError, match="lookahead"):
        P.plan(inputs(), lookahead=-1)


def test_compute_seconds_from_fences_excludes_stalls():
    ms = 1_000_000
    # unit 0: 0..10; unit 1 waited for weights until 30, ran 30..45; unit 2 queued behind it.
    dispatch = [0, 30 * ms, 31 * ms]
    fences = [10 * ms, 45 * ms, 60 * ms]
    assert P.compute_seconds_from_fences(dispatch, fences) == pytest.approx([0.010, 0.015, 0.015])


def test_measure_takes_rates_from_stats():
    from prefetchd.telemetry.stats import Stats
    s = Stats()
    s.record_transfer("load", 100 * MiB, 0.1)
    s.record_transfer("h2d", 100 * MiB, 0.025)
    inp = P.measure([MiB], [0], [5_000_000], stats=s, high_watermark=4 * MiB, host_budget=0)
    assert inp.disk_rate == pytest.approx(100 * MiB / 0.1)
    assert inp.h2d_rate == pytest.approx(100 * MiB / 0.025)
    assert inp.compute_seconds == pytest.approx((0.005,))
    with pytest.raises(ValueError, match="disk"):
        P.measure([MiB], [0], [1], stats=Stats(), high_watermark=4 * MiB, host_budget=0)


def test_fence_clock_times_fences_as_compute_reaches_them():
    marker = FakeMarker()
    clock = FenceClock(marker)
    for epoch in (1, 2, 3):
        clock.unit(epoch, time.monotonic_ns())

    def compute():
        for epoch in (1, 2, 3):
            time.sleep(0.03)
            marker.reach(epoch)
    t = threading.Thread(target=compute)
    t.start()
    t.join()
    dispatch, fences = clock.stop()
    seconds = P.compute_seconds_from_fences(dispatch, fences)
    assert len(seconds) == 3
    assert all(0.02 < s < 0.2 for s in seconds), seconds


def test_fence_clock_reports_fences_never_reached():
    clock = FenceClock(FakeMarker())
    clock.unit(1, time.monotonic_ns())
    with pytest.raises(TimeoutError, match="0 of 1"):
        clock.stop(timeout=0.3)


@pytest.mark.parametrize("waiting", ["for a unit", "at a fence"])
def test_a_fence_clock_ends_once_its_daemon_closed_though_never_sealed(waiting):
    """A pass cut short by Daemon.close() never seals its clock: the thread waited for
    the next unit for good, one more per such close (an outside probe counted them)."""
    alive = threading.Event()
    alive.set()
    clock = FenceClock(FakeMarker(), alive=alive.is_set)
    if waiting == "at a fence":
        clock.unit(1, time.monotonic_ns())          # never reached
    time.sleep(2 * FenceClock.WAKE)
    assert clock._thread.is_alive()                 # alive: it goes on waiting
    alive.clear()
    clock._thread.join(5 * FenceClock.WAKE)
    assert not clock._thread.is_alive()


def test_copies_on_compute_cores_stretch_compute_by_their_contention():
    # Host tier, compute-bound: 8 units of 50 ms, each a 16.8 ms memcpy at 4 GB/s.
    dma = P.plan(inputs(compute=0.05, tier="host", copy_contention=0))
    cpu = P.plan(inputs(compute=0.05, tier="host", copy_contention=1))
    copies = 8 * 64 * MiB / 4e9
    assert dma.bound == "compute"
    assert dma.pass_seconds == pytest.approx(8 * 0.05, rel=0.02)
    # A memcpy holding one core holds back kernels spread over all of them.
    assert cpu.pass_seconds == pytest.approx(8 * 0.05 + copies, rel=0.02)
    half = P.plan(inputs(compute=0.05, tier="host", copy_contention=0.5))
    assert half.pass_seconds == pytest.approx(8 * 0.05 + copies / 2, rel=0.02)


def test_copy_cpu_rate_charges_compute_for_the_memcpy_not_for_a_slowed_stream():
    # The stream ran at 2 GB/s with compute beside it; the memcpy alone runs at 8 GB/s.
    # Compute loses the memcpy's CPU seconds, not the stream's slowed seconds.
    stream_rate, memcpy_rate = 2e9, 8e9
    copies_cpu = 8 * 64 * MiB / memcpy_rate
    p = P.plan(inputs(compute=0.1, tier="host", h2d=stream_rate, copy_contention=1, copy_cpu_rate=memcpy_rate))
    assert p.bound == "compute"
    assert p.pass_seconds == pytest.approx(8 * 0.1 + copies_cpu, rel=0.02)
    unset = P.plan(inputs(compute=0.1, tier="host", h2d=stream_rate, copy_contention=1))
    assert unset.pass_seconds == pytest.approx(8 * 0.1 + 8 * 64 * MiB / stream_rate, rel=0.02)
    with pytest.raises(ValueError, match="copy_cpu_rate"):
        inputs(copy_cpu_rate=-1)


def test_disk_reads_straight_to_the_device_take_no_compute():
    # Remote tier, no host cache: every load is a disk read (DMA on any backend).
    assert P.plan(inputs(compute=0.05, copy_contention=1)).pass_seconds == pytest.approx(
        P.plan(inputs(compute=0.05, copy_contention=0)).pass_seconds)


def test_checksums_of_disk_reads_are_cpu_work_where_copies_contend():
    # Remote tier, no host cache, compute-bound: every unit is a 64 MiB disk read whose
    # CRC32C (at 10 GB/s) runs on the CPU.
    checksums = 8 * 64 * MiB / 10e9
    free = P.plan(inputs(compute=0.1, copy_contention=1))
    cpu = P.plan(inputs(compute=0.1, copy_contention=1, checksum_rate=10e9))
    dma = P.plan(inputs(compute=0.1, copy_contention=0, checksum_rate=10e9))
    assert cpu.pass_seconds == pytest.approx(free.pass_seconds + checksums, rel=0.02)
    assert dma.pass_seconds == pytest.approx(free.pass_seconds)
    with pytest.raises(ValueError, match="checksum_rate"):
        inputs(checksum_rate=-1)


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_copy_contention_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match="copy_contention"):
        inputs(copy_contention=bad)


def test_pooled_gives_units_of_one_kind_their_median():
    seconds = [0.060, 0.010, 0.012, 0.011, 0.030, 0.500]
    kinds = ["block", "block", "block", "block", "head", "head"]
    # 4 blocks: the first one's one-off cost is dropped; 2 heads are too few to pool.
    assert P.pooled(seconds, kinds) == [0.0115] * 4 + [0.030, 0.500]
    assert P.pooled(seconds, kinds, least=2)[4:] == [0.265, 0.265]
    with pytest.raises(ValueError, match="6 compute times but 2"):
        P.pooled(seconds, kinds[:2])


def test_measure_pools_compute_by_unit_kind():
    ms_ = 1_000_000
    dispatch = [0, 100 * ms_, 200 * ms_, 300 * ms_]
    fence = [60 * ms_, 110 * ms_, 210 * ms_, 310 * ms_]
    common = dict(high_watermark=1024 * MiB, host_budget=1024 * MiB, disk_rate=1e9, h2d_rate=4e9)
    raw = P.measure([MiB] * 4, dispatch, fence, **common)
    assert raw.compute_seconds == pytest.approx((0.06, 0.01, 0.01, 0.01))
    assert P.measure([MiB] * 4, dispatch, fence, unit_kinds=["b"] * 4, **common).compute_seconds == \
        pytest.approx((0.01,) * 4)


def test_rates_since_a_snapshot_count_only_what_moved_in_between():
    from prefetchd.telemetry.stats import Stats
    live = Stats()
    live.record_transfer("load", 100 * MiB, 1.0)          # the recording pass: slow first writes
    live.record_transfer("h2d", 100 * MiB, 1.0)
    before = live.snapshot()
    live.record_transfer("h2d", 400 * MiB, 0.1)
    disk, h2d = P.rates_from_stats(live.snapshot(), since=before)
    assert disk is None                                   # no disk read in between
    assert h2d == pytest.approx(400 * MiB / 0.1)


def test_a_refinement_takes_each_passes_rates_until_they_settle():
    from prefetchd.cost.refine import PASSES, Refinement
    from prefetchd.telemetry.stats import Stats

    def moved(stats, disk_bytes, disk_s, h2d_bytes, h2d_s):
        stats.record_transfer("load", disk_bytes, disk_s)
        stats.record_transfer("h2d", h2d_bytes, h2d_s)
        return stats.snapshot()

    live = Stats()
    start = Refinement(inputs(), live.snapshot())
    timed = start.inputs.compute_seconds                                 # compute timed in the pass
    assert start.left == PASSES
    first, following = start.step(moved(live, 2e9, 1.0, 8e9, 1.0), timed)   # 2 and 8 GB/s: moved a lot
    assert (first.disk_rate, first.h2d_rate) == (2e9, 8e9) and following.left == PASSES - 1
    nothing, later = following.step(live.snapshot())                     # a pass that moved nothing...
    assert nothing is None and later.left == PASSES - 2 and later.since is following.since
    following = later                                                    # ...refines nothing, and goes on
    same, untimed = following.step(moved(live, 2.1e9, 1.0, 8e9, 1.0))    # within 10%, compute not timed:
    assert same.disk_rate == pytest.approx(2.1e9) and untimed is not None    # not settled
    settled, done = untimed.step(moved(live, 2.1e9, 1.0, 8e9, 1.0), timed)  # timed and within 10%
    assert settled.disk_rate == pytest.approx(2.1e9) and done is None


def test_a_refinement_keeps_the_copy_rate_where_copies_share_computes_cores():
    """On the cpu backend a pass's copies are slowed by the compute beside them, which the
    plan charges to compute already (copy_contention): only the disk rate is refined."""
    from prefetchd.cost.refine import Refinement
    from prefetchd.telemetry.stats import Stats
    live = Stats()
    start = Refinement(inputs(h2d=9e9, copy_contention=1, copy_cpu_rate=9e9), live.snapshot())
    live.record_transfer("load", 1e9, 1.0)
    live.record_transfer("h2d", 3e9, 1.0)                                 # slowed to 3 GB/s in the pass
    refined, _ = start.step(live.snapshot())
    assert (refined.disk_rate, refined.h2d_rate) == (1e9, 9e9)
    live.record_transfer("h2d", 3e9, 1.0)                                 # a pass of copies only
    assert start.step(live.snapshot())[0].h2d_rate == 9e9


def test_a_refinement_takes_compute_timed_in_a_streamed_pass_and_charges_no_copies_again():
    """Compute timed in a streamed pass holds what the copies beside it took from compute's
    cores already: the refined inputs charge copies nothing more and plan the copy stream at
    the rate it ran beside compute."""
    from prefetchd.cost.refine import Refinement
    from prefetchd.telemetry.stats import Stats
    live = Stats()
    start = Refinement(inputs(h2d=9e9, copy_contention=1, copy_cpu_rate=9e9, tier="host"), live.snapshot())
    live.record_transfer("h2d", 3e9, 1.0)
    timed = [0.005] * len(start.inputs.compute_seconds)
    refined, following = start.step(live.snapshot(), timed)
    assert refined.compute_seconds == tuple(timed)
    assert (refined.copy_contention, refined.copy_cpu_rate, refined.h2d_rate) == (0.0, 0.0, 3e9)
    assert following is not None, "compute changed by more than SETTLED: not settled yet"
    assert P.plan(refined).pass_seconds < P.plan(start.inputs).pass_seconds


def test_fence_clock_sealed_ends_its_thread_once_the_fences_are_reached():
    marker = FakeMarker()
    clock = FenceClock(marker)
    clock.unit(1, time.monotonic_ns())
    clock.seal()
    assert not clock.reached()
    marker.reach(1)
    clock._thread.join(2.0)
    assert not clock._thread.is_alive() and clock.reached()
    assert len(clock.stop()[1]) == 1


def test_fence_clock_closed_ends_its_thread_without_its_fences():
    clock = FenceClock(FakeMarker())
    clock.unit(1, time.monotonic_ns())
    clock.close()
    clock._thread.join(2.0)
    assert not clock._thread.is_alive()
