"""`prefetchd bench soak`: a long mixed workload that must end with nothing lost or leaked.

For the given duration, against one daemon:
- a model streams through the layer hooks, each output compared with the
  resident model's;
- producer threads prefetch, pin, write, evict and flush random tensors of
  their own, checking every value they read against the last they wrote;
- a client thread drives the daemon over its ZeroMQ control plane (when the
  service is available);
- the watermarks move now and then, and the native engine fails a read or a
  write with EIO at a low rate;
- a listener raises on some residency events (Python-level exceptions on the
  scheduler thread, which must keep serving);
- a second process tries to open the same store now and then, and must be
  refused (the store is locked), never share it.

Reports operations, errors by kind (injected faults surface as precise
errors), data mismatches (must be 0), peak device bytes against the high
watermark (must never exceed), RSS growth, and open fds / threads after close
compared with before start.
"""
import collections
import os
import random
import threading
import time

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
# MindSpore 2.10 cannot dispatch ops from two threads at once (it can abort the
# process; docs/mindspore-notes.md). The workers take this around their
# MindSpore calls, and take it before pinning, so whoever holds it waits only
# on the daemon; the daemon calls, which are what the soak is for, stay concurrent.
_MINDSPORE = threading.Lock()


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class _Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.ops = collections.Counter()
        self.errors = collections.Counter()
        self.mismatches = 0

    def op(self, kind):
        with self.lock:
            self.ops[kind] += 1

    def error(self, exc):
        with self.lock:
            self.errors[type(exc).__name__] += 1

    def mismatch(self):
        with self.lock:
            self.mismatches += 1


def _producer_tensors(ms, daemon, tid, rng, tensors_per_thread=8):
    """One producer's tensors, registered before any fault is injected (an injected
    EIO on a registration's read-back is a correct refusal, but would leave the
    producer with nothing to work on)."""
    params, expected = [], []
    for k in range(tensors_per_thread):
        n = rng.choice([16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB]) // 4
        v = np.full(n, tid * 100 + k, np.float32)
        p = ms.Parameter(ms.Tensor(v), name=f"soak.{tid}.{k}")
        daemon.register(p, tier=rng.choice(["remote", "host", "device"]))
        params.append(p)
        expected.append(v.copy())
    return params, expected


def _producer(ms, daemon, params, expected, rng, stop, counters):
    from ..errors import BudgetError, PinnedError, PrefetchdError
    futures = collections.deque()
    while not stop.is_set():
        k = rng.randrange(len(params))
        name = params[k].name
        op = rng.choice(["prefetch", "prefetch", "read", "read", "write", "evict", "flush"])
        counters.op(op)
        try:
            if op == "prefetch":
                futures.append(daemon.prefetch(name, priority=rng.randrange(3)))
            elif op == "evict":
                futures.append(daemon.evict(name))
            elif op == "flush":
                futures.append(daemon.flush(name))
            else:
                with _MINDSPORE, daemon.use(name):
                    if not np.array_equal(params[k].asnumpy(), expected[k]):
                        counters.mismatch()
                    if op == "write":
                        new = np.full_like(expected[k], float(rng.randrange(1 << 20)))
                        params[k][:] = ms.Tensor(new)
                        expected[k] = new
        except (BudgetError, PinnedError, PrefetchdError) as e:
            counters.error(e)
        while len(futures) > 32 or (futures and futures[0].done()):
            f = futures.popleft()
            try:
                f.result(30)
            except (BudgetError, PinnedError, PrefetchdError) as e:
                counters.error(e)
            except Exception as e:   # a timeout here would be a hang: counted, reported
                counters.error(e)
    for f in futures:
        try:
            f.result(30)
        except Exception as e:
            counters.error(e)


def _streamer(ms, daemon, stop, counters):
    from ..hooks.offload import offload
    from ..demo.model import build_model, make_inputs
    with _MINDSPORE:
        ref = build_model(256, 6, seed=9)
        x = make_inputs(2, 8, 256, seed=10)
        want = ref(x).asnumpy()
        model = build_model(256, 6, seed=9)
        offload(model, daemon, lookahead=2, auto_fetch=True)
    while not stop.is_set():
        counters.op("forward")
        try:
            with _MINDSPORE:
                out = model(x).asnumpy()
            if not np.array_equal(out, want):
                counters.mismatch()
        except Exception as e:
            counters.error(e)


def _remote_client(daemon, stop, counters, directory):
    from ..control import Client
    endpoint = f"ipc://{directory}/soak.sock"
    try:
        daemon.serve(endpoint)
    except Exception as e:
        return f"service did not start: {e}"
    rng = random.Random(7)
    with Client(endpoint, timeout=10.0) as client:
        while not stop.is_set():
            names = daemon.names()
            try:
                if rng.random() < 0.5:
                    counters.op("remote_status")
                    client.status()
                else:
                    counters.op("remote_prefetch")
                    client.prefetch([rng.choice(names)])
            except Exception as e:
                counters.error(e)
            time.sleep(0.005)
    return "ok"


def _second_process_opens(store_dir):
    """'refused' if another process is kept out of the store, 'opened' if it got in."""
    import subprocess
    import sys
    code = ("import sys; from prefetchd import _native\n"
            "try:\n    _native.FileStore(sys.argv[1])\nexcept _native.StoreInUse:\n    print('refused')\n"
            "else:\n    print('opened')\n")
    out = subprocess.run([sys.executable, "-c", code, store_dir], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or f"failed: {out.stderr.strip()[-200:]}"


def _thread(name, crashed, fn, *args):
    """A worker thread whose uncaught exception is recorded in `crashed` (a worker that
    died early would otherwise just stop adding load, and the soak would still pass)."""
    def run():
        try:
            fn(*args)
        except BaseException as e:
            crashed.append(f"{name}: {type(e).__name__}: {e}")
            raise
    return threading.Thread(target=run, name=name)


def _raising_listener(rng, counters):
    def listener(event):
        if rng.random() < 0.05:
            counters.op("listener_raised")
            raise RuntimeError(f"injected listener failure on {event['event']}")
    return listener


def run(directory, seconds=60.0, producers=3, fault_every=0.5, seed=1):
    from .. import _native
    from ..backend.framework import mindspore
    from ..daemon import Daemon
    ms = mindspore()
    ms.set_device("CPU")
    os.makedirs(directory, exist_ok=True)
    # Warm MindSpore up first: it opens libraries and files on first use, which
    # are not ours to count as leaks.
    ms.nn.Dense(8, 8)(ms.Tensor(np.ones((1, 8), np.float32))).asnumpy()
    threads_before = threading.active_count()
    fds_before = len(os.listdir("/proc/self/fd"))
    rss_start = _rss()
    counters = _Counters()
    stop = threading.Event()
    peak_violations = []
    daemon = Daemon(store_dir=os.path.join(directory, "store"), device_budget="48MiB", name="soak").start()
    daemon.add_reserve_check(lambda used, high: used > high and peak_violations.append((used, high)))
    daemon.add_listener(_raising_listener(random.Random(seed + 99), counters))
    second_process = collections.Counter()
    remote = {"status": "not started"}
    results = {}
    crashed = []
    for i in range(producers):
        rng = random.Random(seed + i)
        results[i] = _producer_tensors(ms, daemon, i, rng) + (rng,)
    workers = [_thread(f"soak-producer-{i}", crashed, _producer, ms, daemon, *results[i], stop, counters)
               for i in range(producers)]
    workers.append(_thread("soak-stream", crashed, _streamer, ms, daemon, stop, counters))
    workers.append(_thread("soak-remote", crashed, lambda: remote.__setitem__("status", _remote_client(
        daemon, stop, counters, directory))))
    rng = random.Random(seed)
    started = time.monotonic()
    faults = 0
    for w in workers:
        w.start()
    second_process[_second_process_opens(os.path.join(directory, "store"))] += 1   # at least once
    try:
        while time.monotonic() - started < seconds:
            time.sleep(fault_every)
            if rng.random() < 0.3:
                _native.inject_fault(rng.choice(["read", "write"]), "error", nth=rng.randrange(1, 20),
                                     err=5, key_contains="soak.")
                faults += 1
            if rng.random() < 0.1:
                daemon.set_watermarks(rng.choice([0.6, 0.8, 0.95]), None)
            if rng.random() < 0.05:
                second_process[_second_process_opens(os.path.join(directory, "store"))] += 1
    finally:
        stop.set()
        for w in workers:
            w.join(120)
        hung = [w.name for w in workers if w.is_alive()]
        _native.clear_faults()
    # every value, after all that, reads back as last written
    daemon.set_watermarks(0.95, None).result(30)
    for params, expected, _ in results.values():
        for p, want in zip(params, expected):
            try:
                with daemon.use(p.name):
                    if not np.array_equal(p.asnumpy(), want):
                        counters.mismatch()
            except Exception as e:
                counters.error(e)
    status, stats = daemon.snapshot()
    daemon.close()
    del results
    time.sleep(0.2)
    report = {
        "benchmark": "soak", "seconds": round(time.monotonic() - started, 1),
        "operations": dict(counters.ops), "operations_total": sum(counters.ops.values()),
        "errors_by_kind": dict(counters.errors), "faults_injected": faults,
        "io_errors": stats.io_errors, "checksum_failures": stats.checksum_failures,
        "data_mismatches": counters.mismatches,
        "peak_device_bytes": status["device"]["peak"], "high_watermark_at_end": status["device"]["high_watermark"],
        "watermark_violations": len(peak_violations),
        "rss_start_bytes": rss_start, "rss_end_bytes": _rss(),
        "fds_before": fds_before, "fds_after": len(os.listdir("/proc/self/fd")),
        "threads_before": threads_before, "threads_after": threading.active_count(),
        "hung_threads": hung, "crashed_threads": crashed, "remote_client": remote["status"],
        "second_process": dict(second_process),
    }
    report["rss_growth_bytes"] = report["rss_end_bytes"] - rss_start
    report["ok"] = (report["data_mismatches"] == 0 and not peak_violations and not hung and not crashed
                    and set(second_process) <= {"refused"}
                    and report["fds_after"] <= fds_before and report["threads_after"] <= threads_before)
    return report
