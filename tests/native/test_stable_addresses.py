"""Stable addresses through the Daemon: each weight keeps one address for life, a
non-resident one faults instead of being read, no rebinds, and no memory up front."""
import os
import subprocess
import sys
import textwrap

import numpy as np

import prefetchd
from prefetchd.demo.model import build_model, estimate_bytes, make_inputs

MiB = 1 << 20


def _rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_large_budget_costs_no_memory_at_start(store_dir):
    before = _rss()
    with prefetchd.Daemon(store_dir=store_dir, device_budget="8GiB", host_budget="1GiB") as d:
        assert d.status()["device"]["capacity"] == 8 << 30
        assert _rss() - before < 256 * MiB, "the device budget was faulted in at start()"


def test_streaming_keeps_every_weight_at_one_address_with_zero_rebinds(make_daemon):
    hidden, layers = 128, 6
    model = build_model(hidden, layers, seed=2)
    x = make_inputs(2, 4, hidden, seed=3)
    want = model(x).asnumpy()
    daemon = make_daemon(device_budget=max(int(estimate_bytes(hidden, layers) * 0.3), MiB))
    prefetchd.offload(model, daemon, lookahead=1)
    addresses = {p.name: p.data_ptr() for p in model.get_parameters()}
    for _ in range(4):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert {p.name: p.data_ptr() for p in model.get_parameters()} == addresses
    stats = daemon.snapshot()[1]
    assert stats.rebinds == 0
    assert sum(stats.evictions.values()) > 0, "the budget was large enough to keep everything"


def test_reading_an_evicted_weight_faults_instead_of_returning_other_bytes(tmp_path):
    script = textwrap.dedent(f"""
        import ctypes, numpy as np, mindspore as ms, prefetchd
        ms.set_device("CPU")
        with prefetchd.Daemon(store_dir={str(tmp_path / "store")!r}, device_budget="16MiB") as d:
            p = ms.Parameter(ms.Tensor(np.ones(4096, np.float32)), name="w")
            h = d.register(p, tier="remote")
            with d.use(h):
                address = p.data_ptr()
                assert float(p.asnumpy()[0]) == 1.0
            d.evict(h).result(10)
            assert p.data_ptr() == address          # the same address, now unmapped
            print("reading", flush=True)
            ctypes.c_float.from_address(address).value   # what a stray kernel read would do
            print("read returned", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GLOG_v": "3"})
    assert "reading" in out.stdout and "read returned" not in out.stdout, out.stdout + out.stderr
    assert out.returncode == -11, (out.returncode, out.stderr[-2000:])
    assert "prefetchd: a managed tensor was read while it was not resident" in out.stderr, out.stderr[-2000:]


def test_a_functional_op_on_an_evicted_weight_is_refused_before_any_kernel_reads_it(tmp_path):
    """ops.mul(param, 2) outside a forward or use(): the kernel would read the detached home
    and the process would die (it did, after one line on stderr). The guard (prefetchd/guard.py)
    refuses the op with NotResidentError first; the process goes on, and inside use() the op
    gives the weight's values. In a child process: a regression dies there, not in pytest."""
    script = textwrap.dedent(f"""
        import numpy as np, mindspore as ms, prefetchd
        ms.set_device("CPU")
        d = prefetchd.Daemon(store_dir={str(tmp_path / "store")!r}, device_budget="16MiB").start()
        p = ms.Parameter(ms.Tensor(np.ones(4096, np.float32)), name="w")
        d.register(p, tier="remote")
        d.evict("w").result(10)
        print("multiplying", flush=True)
        try:
            ms.ops.mul(p, 2.0).asnumpy()
        except prefetchd.NotResidentError as e:
            print("refused", "'w'" in str(e) and "daemon.use" in str(e), flush=True)
        with d.use([p]):
            print(float(ms.ops.mul(p, 2.0).asnumpy()[0]), flush=True)
        d.close()
    """)
    out = subprocess.run([sys.executable, "-X", "faulthandler", "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "GLOG_v": "3"})
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])
    assert out.stdout.splitlines() == ["multiplying", "refused True", "2.0"], out.stdout + out.stderr[-2000:]
