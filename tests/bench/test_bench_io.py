"""`prefetchd bench io` (README's command table), sweep included: it measured nothing once the
FileStore took a directory lock, since it opened a store per config on one directory at once."""
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_io(tmp_path, *flags):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "bench", "io", "--size", "1MiB", "--repeats", "2",
                          "--no-drop-caches", "--json", "--dir", str(scratch), *flags],
                         capture_output=True, text=True, cwd=REPO, timeout=240)
    assert out.returncode == 0, out.stderr
    assert os.listdir(scratch) == [], "the benchmark left its files behind"
    return json.loads(out.stdout)


def _check_rows(doc, configs):
    assert doc["size"] == 1 << 20 and doc["repeats"] == 2
    rows = doc["filestore"]
    assert sorted((r["engine"], r["block_size"], r["queue_depth"]) for r in rows) == sorted(configs)
    for r in rows:
        assert r["engine_used"] in ("aio", "threads", "buffered"), r
        assert len(r["read_MBps"]["samples"]) == 2 and min(r["read_MBps"]["samples"]) > 0, r
        assert len(r["write_MBps"]["samples"]) == 2 and min(r["write_MBps"]["samples"]) > 0, r
        assert r["ratio_direct_over_buffered"] > 0
    assert doc["baselines"]["python_readinto_aligned"]["median"] > 0
    assert doc["best"]["name"] in {r["name"] for r in rows}


def test_sweep_measures_every_engine_block_size_and_queue_depth(tmp_path):
    doc = bench_io(tmp_path, "--sweep")
    MiB = 1 << 20
    _check_rows(doc, [(e, bs * MiB, qd) for e in ("aio", "threads") for bs in (1, 4, 8, 16) for qd in (1, 2, 4, 8)])


def test_default_run_measures_the_default_store(tmp_path):
    doc = bench_io(tmp_path)
    _check_rows(doc, [("auto", 8 << 20, 8)])
