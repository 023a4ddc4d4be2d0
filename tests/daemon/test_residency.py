"""Residency invariants under random interleavings from several threads (hypothesis).

Against the real CPU backend: the watermark is checked inside the scheduler at
every reservation; pinned tensors must not move; every value read equals the
last value written; every future completes within a bound (no deadlock).
"""
import concurrent.futures
import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from prefetchd import Daemon
from prefetchd.errors import BudgetError, PinnedError
from prefetchd.core.records import State

KiB = 1 << 10
BOUND = 20.0    # seconds any single future may take before we call it a deadlock
# MindSpore 2.10 cannot dispatch ops from two threads at once (it can abort the
# process; docs/mindspore-notes.md). The workers take this around their own
# MindSpore calls; their daemon calls, which are what is under test, stay concurrent.
MINDSPORE = threading.Lock()

OPS = st.sampled_from(["prefetch", "evict", "use_read", "use_write", "flush", "watermarks", "register"])
THREAD_PLAN = st.lists(st.tuples(OPS, st.integers(0, 5), st.integers(0, 1000)), min_size=5, max_size=30)


class Worker:
    """One thread's view: it writes only its own tensors, reads and evicts anyone's."""

    def __init__(self, ms, daemon, tid, sizes):
        self.ms, self.d, self.tid = ms, daemon, tid
        self.params, self.expected = [], []
        for k, n in enumerate(sizes):
            self._register(k, n)
        self.futures = []
        self.errors = []

    def _register(self, k, n, tier=None):
        v = np.full(n, self.tid * 1000 + k, np.float32)
        tier = tier or ("remote", "host", "device")[k % 3]
        with MINDSPORE:     # registering binds the parameter: a MindSpore call
            p = self.ms.Parameter(self.ms.Tensor(v), name=f"t{self.tid}.{k}")
            self.d.register(p, tier=tier)
        self.params.append(p)
        self.expected.append(v.copy())

    def run(self, plan, everyone):
        for op, i, arg in plan:
            try:
                self.step(op, i, arg, everyone)
            except Exception as e:          # recorded; the test asserts none happened
                self.errors.append(repr(e))

    def step(self, op, i, arg, everyone):
        d = self.d
        k = i % len(self.params)
        name = self.params[k].name
        if op == "prefetch":
            other = everyone[arg % len(everyone)]
            self.futures.append(("prefetch", d.prefetch(other.params[i % len(other.params)].name,
                                                        priority=arg % 3)))
        elif op == "evict":
            other = everyone[arg % len(everyone)]
            self.futures.append(("evict", d.evict(other.params[i % len(other.params)].name)))
        elif op in ("use_read", "use_write"):
            rec = d.record(name)
            with d.use(name):
                address = rec.block.address
                with MINDSPORE:
                    got = self.params[k].asnumpy()
                np.testing.assert_array_equal(got, self.expected[k], err_msg=f"{name} read back wrong")
                if op == "use_write":
                    new = np.full_like(self.expected[k], float(arg))
                    with MINDSPORE:
                        self.params[k][:] = self.ms.Tensor(new)
                    self.expected[k] = new
                assert rec.state in (State.RESIDENT, State.STORING), "pinned tensor lost its device replica"
                assert rec.block.address == address, "pinned tensor moved"
        elif op == "flush":
            self.futures.append(("flush", d.flush()))
        elif op == "watermarks":
            budget = d.config.device_budget
            high = budget // 2 + (arg % 5) * budget // 10
            self.futures.append(("watermarks", d.set_watermarks(high, high * 3 // 4)))
        elif op == "register" and len(self.params) < 8:
            self._register(len(self.params), 4 * KiB * (1 + arg % 10), tier="remote")

    def settle(self):
        for kind, f in self.futures:
            try:
                f.result(BOUND)
            except concurrent.futures.TimeoutError:
                self.errors.append(f"{kind} future did not complete within {BOUND}s")
            except PinnedError:
                assert kind == "evict"          # another thread held a pin: a correct refusal
            except BudgetError:
                assert kind == "prefetch"       # a hint that could not be placed
            except Exception as e:
                self.errors.append(f"{kind}: {e!r}")


@settings(max_examples=int(os.environ.get("PREFETCHD_HYPOTHESIS_EXAMPLES", "40")), deadline=None, suppress_health_check=list(HealthCheck))
@given(plans=st.lists(THREAD_PLAN, min_size=2, max_size=3),
       sizes=st.lists(st.integers(1, 10), min_size=2, max_size=5))
def test_invariants_under_random_interleavings(tmp_path_factory, mindspore_cpu, plans, sizes):
    store = tmp_path_factory.mktemp("store")
    violations = []
    # Tensors are at most 160 KiB, so three threads pinning one each always fit
    # under the lowest high watermark the plans set (half of 1 MiB).
    d = Daemon(store_dir=str(store), device_budget="1MiB", shutdown_timeout=10).start()
    d.add_reserve_check(lambda used, high: used > high and violations.append((used, high)))
    try:
        workers = [Worker(mindspore_cpu, d, t, [s * 4 * KiB for s in sizes]) for t in range(len(plans))]
        threads = [threading.Thread(target=w.run, args=(plan, workers)) for w, plan in zip(workers, plans)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "worker thread deadlocked"
        for w in workers:
            w.settle()
        errors = [e for w in workers for e in w.errors]
        assert not errors, errors
        assert not violations, f"watermark exceeded at reservation: {violations[:3]}"
        assert d.status()["device"]["peak"] <= d.config.device_budget
        # Every value reads back as last written, from whichever tier it is on.
        d.set_watermarks(1.0, 0.9).result(BOUND)
        for w in workers:
            for p, want in zip(w.params, w.expected):
                with d.use(p.name):
                    np.testing.assert_array_equal(p.asnumpy(), want)
        d.flush().result(BOUND)   # FIFO queue: every earlier unpin has been applied
        assert all(r.pins == 0 for r in (d.record(n) for n in d.names()))
    finally:
        d.close()
