"""Zero-copy tiers on the cpu backend, through the Daemon and real MindSpore models.

A load from the host tier moves the host block's pages straight under the tensor's home, an
eviction parks them there unreadable and the next load unparks them (core/lending.py): a
weight's bytes are in one place in RAM at a time, and after the disk read no byte is copied
(status()["page_moves"]).
"""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import prefetchd
from prefetchd.demo.model import build_model, estimate_bytes, make_inputs

from .test_page_moves import frames

MiB = 1 << 20


def _moves(daemon):
    return daemon.status()["page_moves"]


def test_a_host_tier_load_moves_the_same_pages_under_the_home_and_the_eviction_parks_them_there(
        make_daemon, make_param):
    d = make_daemon(device_budget="16MiB", host_budget="16MiB")
    values = np.random.default_rng(0).standard_normal(3 * MiB // 4 + 25, dtype=np.float32)  # 3 MiB + 100 B
    p = make_param(values, "w")
    h = d.register(p, tier="host")
    rec = d.record(h)
    host = np.frombuffer(rec.host_block, np.float32, values.size)
    assert np.array_equal(host, values)
    before = frames(rec.host_block, rec.nbytes)
    for _ in range(2):                                 # the first load moves, the second unparks
        with d.use(h):
            assert p.data_ptr() == rec.home.address
            assert np.array_equal(p.asnumpy(), values)
            assert not host.any(), "the host block kept its bytes: the load copied them"
            if None not in before:
                assert frames(rec.home.address, rec.nbytes) == before
            assert d.status()["host"]["lent_bytes"] == rec.nbytes
            assert d.status()["host"]["used"] == rec.nbytes    # its slot stays in the host budget
        d.evict(h).result(10)
        status = d.status()
        assert rec.host_parked and rec.home.parked and not rec.home.attached
        assert status["host"]["parked_bytes"] == rec.nbytes and status["host"]["used"] == rec.nbytes
        assert status["device"]["used"] == 0                 # the device slot is free ...
        assert not host.any()                                # ... and the pages stayed at the home
        if None not in before:
            assert frames(rec.home.address, rec.nbytes) == before
    moves = _moves(d)
    assert moves["copied_bytes"] == 0
    assert moves["moved_bytes"] == moves["returned_bytes"] == moves["parked_bytes"] == 2 * rec.nbytes
    assert moves["unparked_bytes"] == rec.nbytes
    assert moves["moves"] == 1 and moves["protects"] == 3    # one move in; park, unpark, park
    assert moves["seconds"] > 0


def test_the_host_cache_dropping_a_parked_replica_frees_its_pages_and_the_next_load_reads_the_disk(
        make_daemon, make_param):
    d = make_daemon(device_budget="16MiB", host_budget="5MiB", policy="lru")
    a = np.full(MiB, 1.0, np.float32)
    b = np.full(MiB, 2.0, np.float32)
    pa, pb = make_param(a, "a"), make_param(b, "b")
    ha, hb = d.register(pa, tier="remote"), d.register(pb, tier="remote")   # 4 MiB each
    with d.use(ha):
        np.testing.assert_array_equal(pa.asnumpy(), a)
    d.evict(ha).result(10)
    ra = d.record(ha)
    assert ra.host_parked and ra.home.parked
    with d.use(hb):                                      # LRU: b's host replica displaces a's
        np.testing.assert_array_equal(pb.asnumpy(), b)
    assert not ra.host_parked and not ra.home.parked and not ra.host_valid
    assert d.status()["host"]["used"] <= 5 * MiB
    with d.use(ha):                                      # from the disk again, same values
        np.testing.assert_array_equal(pa.asnumpy(), a)
    assert d.status()["loads_from"]["remote"] == 3 and _moves(d)["copied_bytes"] == 0


CASES = {
    "host": dict(tier="host", host=2.0),
    "remote": dict(tier="remote", host=2.0),             # a host budget covering the model
    "remote-small-host": dict(tier="remote", host=0.5),  # partial hits: some loads read the disk
}


@pytest.mark.parametrize("case", CASES)
def test_a_model_streams_from_each_tier_bit_equal_to_resident_with_no_byte_copied(make_daemon, case):
    hidden, layers = 128, 6
    tier, host_share = CASES[case]["tier"], CASES[case]["host"]
    model = build_model(hidden, layers, seed=4)
    x = make_inputs(2, 8, hidden, seed=5)
    want = model(x).asnumpy()
    model_bytes = estimate_bytes(hidden, layers)
    host_budget = int(model_bytes * host_share)
    d = make_daemon(device_budget=max(int(model_bytes * 0.35), MiB), host_budget=host_budget)
    handle = prefetchd.offload(model, d, lookahead=1, tier=tier)
    for _ in range(4):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    status, stats = d.snapshot()
    assert sum(stats.evictions.values()) > 0, "the device budget held the whole model"
    assert status["device"]["peak"] <= status["device"]["high_watermark"]
    assert d.backend.host.peak_used <= host_budget
    moves = status["page_moves"]
    assert moves["copied_bytes"] == 0, moves
    assert moves["moved_bytes"] > 0 and stats.load_bytes_from["host"] > 0
    if case == "remote-small-host":
        assert stats.loads_from["remote"] > layers, "every steady load hit the host tier"
    handle.close()


@pytest.mark.parametrize("tier", ["host", "remote"])
def test_steady_passes_move_no_pages_and_change_protection_only_to_park_and_unpark(make_daemon, tier):
    # A page move flushes the TLB of every core computing once per 2 MiB, a park once
    # per tensor, an unpark never: with a host budget covering the model, a steady pass
    # parks and unparks and moves nothing; clean pages are never made writable and back.
    from prefetchd import _native
    hidden, layers = 128, 6
    model = build_model(hidden, layers, seed=6)
    x = make_inputs(2, 8, hidden, seed=7)
    want = model(x).asnumpy()
    model_bytes = estimate_bytes(hidden, layers)
    d = make_daemon(device_budget=max(int(model_bytes * 0.35), MiB), host_budget=2 * model_bytes)
    handle = prefetchd.offload(model, d, lookahead=1, tier=tier)
    for _ in range(2):                         # recording pass, first streamed pass
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    for _ in range(3):
        before, moves = _native.protection_changes(), _moves(d)
        np.testing.assert_array_equal(model(x).asnumpy(), want)
        after = _moves(d)
        assert after["moves"] == moves["moves"], "a steady pass moved pages"
        assert after["unparked_bytes"] > moves["unparked_bytes"], "a steady pass unparked nothing"
        assert _native.protection_changes() - before == after["protects"] - moves["protects"]
    assert _moves(d)["copied_bytes"] == 0
    handle.close()


def test_a_weight_written_while_resident_is_written_back_and_read_back_equal(make_daemon, make_param, ms):
    d = make_daemon(device_budget="16MiB", host_budget="16MiB")
    p = make_param(np.zeros(1 << 18, np.float32), "w")         # 1 MiB
    h = d.register(p, tier="host")
    rec = d.record(h)
    new = np.arange(1 << 18, dtype=np.float32)
    with d.use(h):
        ms.ops.assign(p, ms.Tensor(new))                        # a kernel writes the home in place
        np.testing.assert_array_equal(p.asnumpy(), new)
    d.evict(h).result(10)                                       # written back before the pages left
    assert rec.remote_valid and not rec.dirty and rec.state.value == "absent"
    stored = np.zeros_like(new)
    d.backend.read_sync("w", stored)
    np.testing.assert_array_equal(stored, new)
    assert rec.host_parked                                      # the written pages wait at the home
    with d.use(h):
        np.testing.assert_array_equal(p.asnumpy(), new)
    assert _moves(d)["copied_bytes"] == 0


def test_a_failed_write_back_of_a_moved_weight_loses_nothing(make_daemon, make_param, ms, native_faults):
    d = make_daemon(device_budget="16MiB", host_budget="16MiB")
    p = make_param(np.zeros(1 << 16, np.float32), "w")
    h = d.register(p, tier="host")
    new = np.full(1 << 16, 7.0, np.float32)
    with d.use(h):
        ms.ops.assign(p, ms.Tensor(new))
        # The kernel has run before the evict looks (MindSpore queues it): otherwise the
        # evict may find the weight clean, drop it, and the late write keeps it dirty and
        # resident with no write-back to fail (core/memory.py, written_late).
        np.testing.assert_array_equal(p.asnumpy(), new)
    native_faults.inject_fault("write", "error", count=1)
    with pytest.raises(prefetchd.StorageError):
        d.evict(h).result(10)
    rec = d.record(h)
    assert rec.state.value == "resident" and rec.dirty and rec.host_lent
    np.testing.assert_array_equal(p.asnumpy(), new)             # held in place under the home
    native_faults.clear_faults()
    d.flush().result(10)
    d.evict(h).result(10)
    with d.use(h):
        np.testing.assert_array_equal(p.asnumpy(), new)


@pytest.mark.parametrize("access", ["read", "write"])
def test_a_stray_access_of_a_weight_whose_pages_are_parked_at_its_home_still_faults(tmp_path, access):
    # Parked pages sit right under the home: only the protection keeps a stray kernel from
    # them, and the write watch must not let a write to a parked home through.
    touch = {"read": "ctypes.c_float.from_address(address).value",
             "write": "ctypes.c_float.from_address(address).value = 2.0"}[access]
    script = textwrap.dedent(f"""
        import ctypes, numpy as np, mindspore as ms, prefetchd
        ms.set_device("CPU")
        with prefetchd.Daemon(store_dir={str(tmp_path / "store")!r}, device_budget="16MiB",
                              host_budget="16MiB") as d:
            p = ms.Parameter(ms.Tensor(np.ones(1 << 20, np.float32)), name="w")
            h = d.register(p, tier="host")
            with d.use(h):
                address = p.data_ptr()
                assert float(p.asnumpy()[0]) == 1.0
            d.evict(h).result(10)
            assert d.status()["host"]["parked_bytes"] == 4 << 20 and d.record(h).home.parked
            print("touching", flush=True)
            {touch}   # what a stray kernel would do
            print("access returned", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GLOG_v": "3"})
    assert "touching" in out.stdout, out.stderr[-2000:]
    assert "access returned" not in out.stdout
    assert out.returncode == -11, (out.returncode, out.stderr[-2000:])
    assert "prefetchd: a managed tensor was read while it was not resident" in out.stderr, out.stderr[-2000:]
