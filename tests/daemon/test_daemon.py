"""Daemon lifecycle and refusals: each refusal is precise, close() is bounded and leaves nothing."""
import concurrent.futures
import threading
import time

import numpy as np
import pytest

from prefetchd import Daemon
from prefetchd.errors import (BudgetError, DoubleRegisterError, NotResidentError, PinnedError,
                              ShutdownError, UnknownTensorError)
from prefetchd.core.records import State

MiB = 1 << 20


def values(i, n=MiB // 4):
    return np.full(n, i, np.float32)


def test_register_use_round_trip_across_tiers(daemon, make_param):
    ps = {tier: make_param(values(k), f"w.{tier}") for k, tier in enumerate(["device", "host", "remote"])}
    handles = {tier: daemon.register(p, tier=tier) for tier, p in ps.items()}
    assert handles["device"].tiers == ["device"]
    assert handles["host"].tiers == ["host"]
    assert handles["remote"].tiers == ["remote"]
    for k, tier in enumerate(["device", "host", "remote"]):
        with daemon.use(handles[tier]):
            assert ps[tier].asnumpy()[0] == k and ps[tier].asnumpy()[-1] == k
        assert "device" in handles[tier].tiers


def test_absent_tensor_raises_not_resident_on_python_use(daemon, make_param):
    p = make_param(values(3), "w")
    h = daemon.register(p, tier="remote")
    with pytest.raises(NotResidentError) as e:
        p.asnumpy()
    assert e.value.name == "w" and e.value.tier == "remote" and e.value.state == "absent"


def test_unknown_name_is_refused(daemon):
    with pytest.raises(UnknownTensorError, match="no tensor named 'nope'"):
        daemon.prefetch("nope")
    with pytest.raises(UnknownTensorError):
        daemon.evict(["nope"])


def test_double_register_is_refused(daemon, make_param):
    p = make_param(values(1), "w")
    daemon.register(p)
    with pytest.raises(DoubleRegisterError, match="already registered"):
        daemon.register(make_param(values(2), "w"))
    with pytest.raises(DoubleRegisterError, match="already registered as 'w'"):
        daemon.register(p, "other")


def test_registering_again_a_tensor_that_is_not_resident_says_it_is_registered(daemon, make_param):
    """The registration read the tensor before it looked at the names: one registered on
    the remote tier (not resident) was refused as a read, NotResidentError."""
    p = make_param(values(1), "w")
    daemon.register(p, tier="remote")
    with pytest.raises(DoubleRegisterError, match="a tensor named 'w' is already registered"):
        daemon.register(p)
    with pytest.raises(DoubleRegisterError, match="already registered as 'w'"):
        daemon.register(p, "other", tier="remote")
    with pytest.raises(DoubleRegisterError, match="a tensor named 'w' is already registered"):
        daemon.register_all([p])
    resident = make_param(values(2), "r")
    daemon.register(resident)               # on the device tier: nothing of it in the store
    with pytest.raises(DoubleRegisterError, match="a tensor named 'r' is already registered"):
        daemon.register_remote("r", (MiB // 4,), "float32")   # said before the store is asked
    with pytest.raises(DoubleRegisterError, match="already registered as 'r'"):
        daemon.register_remote("elsewhere", (MiB // 4,), "float32", target=resident)
    assert sorted(daemon.names()) == ["r", "w"]


def test_tensor_larger_than_the_budget_fails_precisely(make_daemon, make_param):
    d = make_daemon(device_budget="4MiB")
    h = d.register(make_param(np.zeros(2 * MiB, np.float32), "big"), tier="remote")
    with pytest.raises(BudgetError, match="can never fit"):
        d.prefetch(h).result(5)


def test_prefetch_with_everything_pinned_fails_instead_of_waiting(make_daemon, make_param):
    d = make_daemon(device_budget="4MiB", high_watermark="4MiB", low_watermark="3MiB")
    a = d.register(make_param(np.zeros(MiB // 2, np.float32), "a"), tier="remote")   # 2 MiB
    b = d.register(make_param(np.zeros(MiB // 2, np.float32), "b"), tier="remote")
    c = d.register(make_param(np.zeros(MiB // 2, np.float32), "c"), tier="remote")
    with d.use([a]):
        with d.use([b]):
            with pytest.raises(BudgetError, match="pinned"):
                d.prefetch(c).result(5)


def test_evicting_a_pinned_tensor_is_refused(daemon, make_param):
    h = daemon.register(make_param(values(1), "w"), tier="remote")
    with daemon.use(h):
        with pytest.raises(PinnedError, match="pinned"):
            daemon.evict(h).result(5)
        assert h.state is State.RESIDENT
    daemon.evict(h).result(5)
    assert h.state is State.ABSENT


def test_use_after_close_is_refused(store_dir, make_param):
    d = Daemon(store_dir=store_dir, device_budget="16MiB").start()
    h = d.register(make_param(values(1), "w"), tier="remote")
    d.close()
    with pytest.raises(ShutdownError, match="after close"):
        d.prefetch(h)
    with pytest.raises(ShutdownError):
        d.register(make_param(values(2), "v"))
    with pytest.raises(ShutdownError, match="after close"):    # the write could not be kept
        d.mark_dirty(h)
    d.close()   # idempotent


def test_not_started_is_refused(store_dir):
    with pytest.raises(ShutdownError, match="not started"):
        Daemon(store_dir=store_dir).prefetch([])


def test_evict_writes_back_dirty_replicas_and_loses_nothing(daemon, make_param):
    p = make_param(values(1), "w")
    h = daemon.register(p, tier="device")          # only copy: dirty until written back
    assert h.tiers == ["device"]
    daemon.evict(h).result(10)
    assert h.tiers == ["remote"]
    with daemon.use(h):
        p[0:4] = 9.0                               # in-place write marks it dirty
    assert h._rec.dirty
    daemon.evict(h).result(10)
    with daemon.use(h):
        got = p.asnumpy()
    assert got[0] == 9 and got[4] == 1


def test_flush_writes_back_without_evicting(daemon, make_param):
    p = make_param(values(5), "w")
    h = daemon.register(p, tier="device")
    daemon.flush().result(10)
    assert h.tiers == ["device", "remote"] and not h._rec.dirty
    assert daemon.backend.store_contains("w")


def test_priority_orders_pending_loads(make_daemon, make_param):
    d = make_daemon(device_budget="64MiB")
    hs = [d.register(make_param(values(i), f"t{i}"), tier="remote") for i in range(12)]
    order = []
    d.add_listener(lambda e: order.append(e["name"]) if e["event"] == "loaded" else None)
    futures = [d.prefetch(h, priority=i) for i, h in enumerate(hs)]
    concurrent.futures.wait(futures, timeout=20)
    # The first few start at once; among the rest, higher priority loads first.
    rest = order[4:]
    assert rest == sorted(rest, key=lambda n: -int(n[1:])), order


def test_cancelled_prefetch_never_loads(make_daemon, make_param):
    from prefetchd import _native
    d = make_daemon()
    hs = [d.register(make_param(values(i, MiB), f"t{i}"), tier="remote") for i in range(8)]
    # Hold the load stream on a slow read so the later prefetches stay queued.
    _native.inject_fault("read", "delay", nth=1, delay_ms=400)
    try:
        blocker = d.prefetch(hs[0])
        late = [d.prefetch(h) for h in hs[1:]]
        assert late[-1].cancel(), "a queued prefetch must be cancellable"
        blocker.result(10)
        for f in late[:-1]:
            f.result(10)
    finally:
        _native.clear_faults()
    assert late[-1].cancelled()
    assert hs[-1].state is State.ABSENT                 # never loaded
    assert all(h.state is State.RESIDENT for h in hs[:-1])


def test_close_with_work_pending_is_bounded_and_leaves_nothing(store_dir, make_param, no_leaks):
    d = Daemon(store_dir=store_dir, device_budget="32MiB", shutdown_timeout=5).start()
    hs = [d.register(make_param(values(i, 2 * MiB), f"t{i}"), tier="remote") for i in range(16)]
    futures = [d.prefetch(h) for h in hs]
    arena = d.backend.device
    start = time.monotonic()
    d.close(timeout=5)
    assert time.monotonic() - start < 7
    for f in futures:
        assert f.done()
        if not f.cancelled() and f.exception() is not None:
            assert isinstance(f.exception(), ShutdownError)
    assert not any(t.name.startswith("prefetchd-scheduler") and t.is_alive() for t in threading.enumerate())
    import gc
    del hs, futures
    gc.collect()
    assert arena.num_blocks == 0 and arena.used == 0


def test_status_reports_tiers_and_states(daemon, make_param):
    h = daemon.register(make_param(values(1), "w"), tier="remote")
    s = daemon.status()
    assert s["tensors"] == 1 and s["states"]["absent"] == 1
    assert s["device"]["high_watermark"] <= s["device"]["capacity"]
    with daemon.use(h):
        s = daemon.status()
        assert s["pinned"] == 1 and s["pinned_bytes"] == h.nbytes and s["states"]["resident"] == 1
    # Loaded from disk through the host cache: a clean host replica stays behind.
    assert daemon.tensors("w*")[0]["tiers"] == ["device", "host", "remote"]
    assert daemon.tensors("x*") == []


def test_set_watermarks_evicts_down_to_the_new_low(daemon, make_param):
    hs = [daemon.register(make_param(values(i), f"t{i}"), tier="remote") for i in range(8)]
    daemon.prefetch(hs).result(10)
    daemon.set_watermarks(3 * MiB, 2 * MiB).result(10)
    assert daemon.status()["device"]["used"] <= 2 * MiB
    with pytest.raises(ValueError, match="above the high"):
        daemon.set_watermarks(MiB, 2 * MiB)


def test_a_lowered_watermark_holds_once_dirty_tensors_are_written_back(make_daemon, make_param):
    """Dirty tensors evicted by set_watermarks are written back first; their blocks then
    waited for a whole-queue fence that only a later reservation took, so the device held
    more than its new high watermark for as long as nothing else was asked."""
    daemon = make_daemon(device_budget="64MiB", host_budget="0")
    for i in range(14):
        daemon.register(make_param(np.full(1 << 20, i, np.float32), f"d{i}"), tier="device")  # dirty
    daemon.set_watermarks(0.25).result(10)
    deadline = time.monotonic() + 10
    while daemon.status()["states"]["storing"] and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)                  # a few scheduler turns after the last write-back landed
    device = daemon.status()["device"]
    assert device["used"] <= device["high_watermark"] == 16 * MiB
    for i in (0, 13):
        with daemon.use([f"d{i}"]):
            assert (daemon.record(f"d{i}").target.asnumpy() == i).all()


def test_auto_fetch_false_raises_not_resident_on_unrequested_tensor(daemon, make_param):
    h = daemon.register(make_param(values(1), "w"), tier="remote")
    with pytest.raises(NotResidentError, match="'w'"):
        daemon.acquire([h._rec], auto_fetch=False)
    daemon.prefetch(h)
    daemon.acquire([h._rec], auto_fetch=False)
    daemon.unpin([h])


def test_close_at_once_says_write_backs_in_flight_may_have_landed(store_dir, ms, caplog):
    """close(timeout=0) said '16 dirty tensor(s) not written back' of write-backs it had just
    started; they landed, and a reopened store had every one at its current value."""
    import logging
    from prefetchd import Daemon
    n = 64 * 1024
    daemon = Daemon(device_budget="16MiB", store_dir=store_dir).start()
    for i in range(8):
        daemon.register(ms.Tensor(np.full(n, float(i), np.float32)), f"w{i}")      # dirty
    with caplog.at_level(logging.WARNING, logger="prefetchd"):
        daemon.close(timeout=0)
    said = [r.getMessage() for r in caplog.records]
    assert not any("not written back" in m for m in said), said
    assert any("still in flight, each landed whole or not at all" in m for m in said), said
    with Daemon(device_budget="16MiB", store_dir=store_dir) as again:     # landed whole, or not at all
        for i in range(8):
            t = ms.Tensor(np.zeros(n, np.float32))
            try:
                again.register_remote(f"w{i}", (n,), "float32", target=t)
            except UnknownTensorError:
                continue
            with again.use([f"w{i}"]):
                assert (t.asnumpy() == i).all()
