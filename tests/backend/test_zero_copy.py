"""Zero-copy tiers on the cpu backend, through the Daemon and real MindSpore models.

A load from the host tier moves the host block's pages straight under the tensor's home, an
eviction moves them back (core/lending.py): a weight's bytes are in one place in RAM
at a time, and after the disk read no byte is copied (status()["page_moves"]).
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


def test_a_host_tier_load_moves_the_same_pages_under_the_home_and_the_eviction_moves_them_back(
        make_daemon, make_param):
    d = make_daemon(device_budget="16MiB", host_budget="16MiB")
    values = np.random.default_rng(0).standard_normal(3 * MiB // 4 + 25, dtype=np.float32)  # 3 MiB + 100 B
    p = make_param(values, "w")
    h = d.register(p, tier="host")
    rec = d.record(h)
    host = np.frombuffer(rec.host_block, np.float32, values.size)
    assert np.array_equal(host, values)
    before = frames(rec.host_block, rec.nbytes)
    with d.use(h):
        assert p.data_ptr() == rec.home.address
        assert np.array_equal(p.asnumpy(), values)
        assert not host.any(), "the host block kept its bytes: the load copied them"
        if None not in before:
            assert frames(rec.home.address, rec.nbytes) == before
        assert d.status()["host"]["lent_bytes"] == rec.nbytes
        assert d.status()["host"]["used"] == rec.nbytes        # its slot stays in the host budget
    d.evict(h).result(10)
    assert np.array_equal(host, values)                          # back in the same host block ...
    if None not in before:
        assert frames(rec.host_block, rec.nbytes) == before      # ... on the same physical pages
    moves = _moves(d)
    assert moves["copied_bytes"] == 0
    assert moves["moved_bytes"] == moves["returned_bytes"] == rec.nbytes
    assert moves["moves"] == 2 and moves["seconds"] > 0          # host block -> home, and back


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
def test_steady_passes_change_no_page_protection(make_daemon, tier):
    # Each mprotect is a TLB shootdown of every core computing: clean pages keep their
    # read-only protection as they move between the host tier and their homes.
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
    moved = _moves(d)["moved_bytes"]
    changes = []
    for _ in range(3):
        before = _native.protection_changes()
        np.testing.assert_array_equal(model(x).asnumpy(), want)
        changes.append(_native.protection_changes() - before)
    assert _moves(d)["moved_bytes"] > moved, "the steady passes moved nothing"
    assert changes == [0, 0, 0], changes
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
    np.testing.assert_array_equal(np.frombuffer(rec.host_block, np.float32, new.size), new)
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


def test_a_stray_read_of_a_weight_whose_pages_went_back_to_the_host_tier_still_faults(tmp_path):
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
            assert d.status()["page_moves"]["returned_bytes"] == 4 << 20
            assert float(np.frombuffer(d.record(h).host_block, np.float32)[0]) == 1.0
            print("reading", flush=True)
            ctypes.c_float.from_address(address).value   # what a stray kernel read would do
            print("read returned", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GLOG_v": "3"})
    assert "reading" in out.stdout, out.stderr[-2000:]
    assert "read returned" not in out.stdout
    assert out.returncode == -11, (out.returncode, out.stderr[-2000:])
    assert "prefetchd: a managed tensor was read while it was not resident" in out.stderr, out.stderr[-2000:]
