"""`prefetchd bench accelerate`: the line protocol and the ratio math without torch; the whole
bench at a tiny size when an interpreter with torch and accelerate is given."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from prefetchd.bench import accelerate as ba


# -- the protocol, both directions -------------------------------------------------------------

def test_requests_round_trip():
    for method in ba.CHILD_METHODS:
        assert ba.parse_request(ba.format_request(method, 7)) == ("pass", method, 7)
    assert ba.parse_request("save /tmp/x y.npz\n") == ("save", "/tmp/x y.npz")
    assert ba.parse_request("quit\n") == ("quit",)


@pytest.mark.parametrize("line", ["", "pass\n", "pass accelerate\n", "pass accelerate x\n",
                                  "pass prefetchd 1\n", "pass accelerate -1\n", "save\n", "quit now\n",
                                  "run accelerate 1\n"])
def test_bad_requests_are_refused(line):
    with pytest.raises(ba.ProtocolError, match="bad request"):
        ba.parse_request(line)


def test_format_request_refuses_parent_methods():
    with pytest.raises(ValueError, match="unknown child method"):
        ba.format_request("prefetchd", 0)


def test_reply_round_trip_keeps_the_exact_seconds():
    seconds, cpu = 0.123456789012345, 0.25
    line = ba.format_reply("accelerate", 3, seconds, cpu, "abcdef0123456789")
    assert ba.parse_reply(line, "accelerate", 3) == {"seconds": seconds, "cpu_seconds": cpu,
                                                      "digest": "abcdef0123456789"}


@pytest.mark.parametrize("line, match", [
    ("", "exited"),
    ("error RuntimeError: out of memory\n", "failed: RuntimeError: out of memory"),
    ("done accelerate 3 0.1 0.1\n", "bad reply"),
    ("done torch_resident 3 0.1 0.1 d\n", "another request"),
    ("done accelerate 4 0.1 0.1 d\n", "another request"),
    ("done accelerate 3 fast 0.1 d\n", "not numbers"),
    ("done accelerate 3 0 0.1 d\n", "must be > 0"),
    ("done accelerate 3 nan 0.1 d\n", "must be > 0"),
    ("ready {}\n", "bad reply"),
])
def test_bad_replies_are_refused(line, match):
    with pytest.raises(ba.ProtocolError, match=match):
        ba.parse_reply(line, "accelerate", 3)


def test_greeting():
    assert ba.parse_ready('ready {"torch": "2.13.0", "threads": 2}\n') == {"torch": "2.13.0", "threads": 2}
    for line, match in (("ready [1]\n", "not a JSON object"), ("ready {\n", "bad greeting"),
                        ("hello\n", "bad greeting"), ("error ImportError: no torch\n", "no torch")):
        with pytest.raises(ba.ProtocolError, match=match):
            ba.parse_ready(line)


# -- ratios ------------------------------------------------------------------------------------

def test_ratios():
    r = ba.ratios({"accelerate": 6.0, "torch_resident": 1.5, "prefetchd": 2.0, "ms_resident": 1.0})
    assert r["accelerate_over_prefetchd"] == pytest.approx(3.0)
    assert r["accelerate_over_torch_resident"] == pytest.approx(4.0)
    assert r["prefetchd_over_ms_resident"] == pytest.approx(2.0)
    assert r["torch_resident_over_ms_resident"] == pytest.approx(1.5)
    assert r["accelerate_over_ms_resident"] == pytest.approx(6.0)     # the ceiling of the first
    assert r["accelerate_overhead_seconds"] == pytest.approx(4.5)
    assert r["prefetchd_overhead_seconds"] == pytest.approx(1.0)


def test_ratios_with_a_missing_method_are_none():
    r = ba.ratios({"prefetchd": 2.0, "ms_resident": 1.0})
    assert r["accelerate_over_prefetchd"] is None and r["accelerate_overhead_seconds"] is None
    assert r["accelerate_over_ms_resident"] is None
    assert r["prefetchd_over_ms_resident"] == pytest.approx(2.0)


# -- the child's weights are bench model's -----------------------------------------------------

def test_weights_and_input_are_the_ones_bench_model_builds(ms):
    from prefetchd.bench.model_methods import build
    model = build(ms, 32, 3)
    want = [p.asnumpy() for p in model.get_parameters()]
    got = [a for pair in ba.weights(32, 3) for a in pair]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == np.float32 and np.array_equal(g, w)
    assert ba.bench_input(32, 4).shape == (4, 32)


def test_no_torch_interpreter_is_one_clear_line(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(ba.SetupError, match="--torch-python=.*cannot `import torch, accelerate`"):
        ba.find_torch_python(str(fake), env={})
    with pytest.raises(ba.SetupError, match=ba.TORCH_PYTHON_ENV):
        ba.find_torch_python(None, env={ba.TORCH_PYTHON_ENV: str(fake)})


def test_the_child_refuses_bad_requests_and_says_why(tmp_path):
    """The child script under this interpreter: without torch it answers 'error ...' at once;
    the parent turns that into a ProtocolError naming the cause."""
    cfg = {"hidden": 8, "layers": 2, "batch": 1, "threads": 1, "offload_dir": str(tmp_path)}
    out = subprocess.run([sys.executable, ba.child_script.__file__, "--child", json.dumps(cfg)], input="quit\n",
                         capture_output=True, text=True, timeout=120)
    first = out.stdout.splitlines()[0]
    if first.startswith("error "):
        with pytest.raises(ba.ProtocolError, match="failed"):
            ba.parse_ready(first + "\n")
    else:                                          # torch and accelerate happen to be here
        assert ba.parse_ready(first + "\n")["threads"] == 1
        assert out.stdout.splitlines()[1] == "bye"


# -- the whole bench, when torch is available --------------------------------------------------

TORCH_PYTHON = os.environ.get(ba.TORCH_PYTHON_ENV)


@pytest.mark.skipif(not TORCH_PYTHON, reason=f"${ba.TORCH_PYTHON_ENV} is not set: no interpreter with torch "
                    "and accelerate (expected in CI, which installs no torch; the protocol and ratio tests "
                    "above still run)")
def test_bench_at_a_tiny_size(tmp_path):
    report = ba.bench_accelerate(str(tmp_path), size="4MiB", hidden=256, batch=[4], repeats=2,
                                 torch_python=TORCH_PYTHON)
    json.dumps(report)
    assert report["benchmark"] == "accelerate" and report["ok"] is True
    assert report["layers"] == 16 and report["model_bytes"] == 16 * (256 * 256 + 256) * 4
    assert report["threads"] == {"torch": 2, "mindspore": 2}
    assert report["accelerate_offload_bytes"] == report["model_bytes"]
    assert set(report["seconds"]) == set(ba.METHODS) and all(v > 0 for v in report["seconds"].values())
    for name in ba.METHODS:
        assert len(report["methods"][name]["passes"]) == 1 + report["passes"]
    checks = report["checks"]
    assert checks["accelerate_matches_torch_resident"] and checks["prefetchd_matches_ms_resident"]
    assert checks["frameworks_agree"]
    r = report["ratios"]
    assert r["accelerate_over_prefetchd"] == pytest.approx(
        report["seconds"]["accelerate"] / report["seconds"]["prefetchd"])
    assert report["target_reachable"] is (r["accelerate_over_ms_resident"] >= ba.TARGET_SPEEDUP)
    assert report["prefetchd_misses"] == 0
