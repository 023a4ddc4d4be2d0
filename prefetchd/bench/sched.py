"""`prefetchd bench sched`: what the scheduler costs, and whether it keeps the disk busy.

Three measurements in one run:
1. resident hits: prefetch requests for tensors already on the device tier
   (the hot path of the layer hooks) — requests/s and per-call latency;
2. queued round trips: pin + unpin of resident tensors, which go through the
   request queue and the scheduler thread — requests/s and latency;
3. streaming: 64 MiB tensors loaded from the remote tier through the
   scheduler, against the file store read directly (the `bench io` path) on
   the same files in the same run; reports the ratio;
4. many tensors: the cost of one load as the number of registered tensors
   grows (small remote tensors through a host cache of half of them, used in
   turn with prefetches ahead): microseconds per load and the scheduler
   thread's CPU per load at each size, and their ratio between the largest and
   smallest size. A scan of every tensor per load shows as a ratio near the size
   ratio; a per-load cost independent of the model's tensor count, near 1.
"""
import os
import shutil
import statistics
import time

import numpy as np

from .common import cpu_seconds

MiB = 1 << 20


def _percentiles(samples):
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]
    return {"p50_us": pick(0.50) * 1e6, "p99_us": pick(0.99) * 1e6, "max_us": s[-1] * 1e6}


def _drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _tensor(ms, nbytes, i):
    return ms.Parameter(ms.Tensor(np.full(nbytes // 4, i, np.float32)), name=f"t{i}")


def bench_hits(ms, Daemon, directory, requests):
    with Daemon(store_dir=directory, device_budget="64MiB", name="bench-hits") as d:
        names = [d.register(_tensor(ms, 4096, i), tier="device").name for i in range(256)]
        d.prefetch(names).result()
        lat = []
        start = time.perf_counter()
        for i in range(requests):
            t = time.perf_counter()
            d.prefetch(names[i & 255])
            lat.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - start
    return {"requests": requests, "requests_per_s": requests / elapsed, **_percentiles(lat)}


def bench_round_trips(ms, Daemon, directory, requests):
    with Daemon(store_dir=directory, device_budget="64MiB", name="bench-queue") as d:
        names = [d.register(_tensor(ms, 4096, i), tier="device").name for i in range(256)]
        lat = []
        start = time.perf_counter()
        for i in range(requests):
            t = time.perf_counter()
            d.pin(names[i & 255]).result()
            d.unpin(names[i & 255])
            lat.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - start
    return {"requests": requests, "requests_per_s": requests / elapsed, **_percentiles(lat)}


def bench_streaming(ms, Daemon, directory, count=16, nbytes=64 * MiB, repeats=3, lookahead=2):
    from .. import _native
    store_dir = os.path.join(directory, "stream")
    os.makedirs(store_dir, exist_ok=True)
    with Daemon(store_dir=store_dir, device_budget=4 * nbytes + 4 * MiB, name="bench-stream") as d:
        for i in range(count):
            d.register(_tensor(ms, nbytes, i), tier="remote")
        names = d.names()
        engine = d.backend.io_engine
        store = d.backend.store
        sched, direct = [], []
        dst = _native.aligned_buffer(nbytes)
        for _ in range(repeats):
            # (a) the store read directly, one tensor after another (bench io's path)
            cold = _drop_caches()
            t = time.perf_counter()
            for name in names:
                store.read_sync(name, dst, True)
            direct.append(count * nbytes / (time.perf_counter() - t) / 1e6)
            # (b) through the scheduler, as the layer hooks drive it
            d.evict(names).result()
            _drop_caches()
            t = time.perf_counter()
            _use_in_turn(d, names, lookahead)
            sched.append(count * nbytes / (time.perf_counter() - t) / 1e6)
            d.evict(names).result()
    shutil.rmtree(store_dir, ignore_errors=True)
    med_s, med_d = statistics.median(sched), statistics.median(direct)
    return {"tensor_bytes": nbytes, "tensors": count, "engine": engine, "page_cache_dropped": cold,
            "scheduler_MBps": {"min": min(sched), "median": med_s, "max": max(sched)},
            "store_direct_MBps": {"min": min(direct), "median": med_d, "max": max(direct)},
            "ratio_scheduler_to_store": med_s / med_d}


def _thread_cpu_seconds(prefix):
    """CPU seconds of this process's thread whose name starts with `prefix` (0 if none)."""
    import threading
    for t in threading.enumerate():
        if t.name.startswith(prefix) and t.native_id is not None:
            return cpu_seconds(f"/proc/self/task/{t.native_id}/stat")
    return 0.0


def _use_in_turn(d, names, lookahead):
    """Use each tensor in turn with `lookahead` prefetches ahead, as the layer hooks drive
    the scheduler (evicting as it goes)."""
    for i in range(lookahead):
        d.prefetch(names[i])
    for i, name in enumerate(names):
        if i + lookahead < len(names):
            d.prefetch(names[i + lookahead])
        with d.use(name):
            pass


def bench_many_tensors(ms, Daemon, directory, sizes=(512, 4096), nbytes=16 << 10, passes=2, lookahead=2):
    """Per load, at each registry size: wall and scheduler-thread CPU microseconds (medians
    over `passes` passes after a warm one; a quarter of the tensors fit the device budget,
    half the host cache)."""
    out = {}
    for count in sizes:
        store_dir = os.path.join(directory, f"many-{count}")
        os.makedirs(store_dir, exist_ok=True)
        total = count * nbytes
        with Daemon(store_dir=store_dir, device_budget=total // 4 + MiB, host_budget=total // 2,
                    name=f"bench-many-{count}") as d:
            for i in range(count):
                d.register(_tensor(ms, nbytes, i), tier="remote")
            names = d.names()
            _use_in_turn(d, names, lookahead)
            wall, cpu = [], []
            for _ in range(passes):
                c, t = _thread_cpu_seconds("prefetchd-scheduler"), time.perf_counter()
                _use_in_turn(d, names, lookahead)
                wall.append((time.perf_counter() - t) / count * 1e6)
                cpu.append((_thread_cpu_seconds("prefetchd-scheduler") - c) / count * 1e6)
        shutil.rmtree(store_dir, ignore_errors=True)
        out[str(count)] = {"us_per_load": statistics.median(wall), "scheduler_cpu_us_per_load": statistics.median(cpu)}
    small, large = out[str(sizes[0])], out[str(sizes[-1])]
    return {"tensor_bytes": nbytes, "sizes": list(sizes), "by_size": out,
            "size_ratio": sizes[-1] / sizes[0],
            "us_per_load_ratio": large["us_per_load"] / small["us_per_load"],
            "scheduler_cpu_per_load_ratio": (large["scheduler_cpu_us_per_load"] / small["scheduler_cpu_us_per_load"]
                                             if small["scheduler_cpu_us_per_load"] else None)}


def run(directory, requests=200_000, repeats=3):
    from ..backend.framework import mindspore
    from ..daemon import Daemon
    ms = mindspore()
    ms.set_device("CPU")
    os.makedirs(directory, exist_ok=True)
    hits = bench_hits(ms, Daemon, os.path.join(directory, "hits"), requests)
    trips = bench_round_trips(ms, Daemon, os.path.join(directory, "queue"), max(1000, requests // 20))
    streaming = bench_streaming(ms, Daemon, directory, repeats=repeats)
    many = bench_many_tensors(ms, Daemon, directory)
    return {
        "benchmark": "sched",
        "resident_hits": hits,
        "queued_pin_unpin": trips,
        "streaming_64MiB": streaming,
        "many_tensors": many,
        "targets": {
            "hits_per_s>=100000": hits["requests_per_s"] >= 100_000,
            "hit_p99<1ms": hits["p99_us"] < 1000,
            "streaming_within_10pct_of_store": streaming["ratio_scheduler_to_store"] >= 0.9,
            # 8x the tensors: a load may cost more (caches, longer lists of what is
            # resident), not 8x more (a scan of every tensor per load)
            "load_cost_within_1.5x_at_8x_tensors": many["us_per_load_ratio"] <= 1.5,
        },
    }
