"""`prefetchd bench serve --quick --json` end to end, through the CLI, with real fronts and
worker processes: the report's structure, and that every phase answered every request
with its own rows (correctness, not speed: the quick model is tiny)."""
import json
import subprocess
import sys

from prefetchd.bench.serve import GENERATE_MODES, INFER_MODES, QUICK_CONCURRENCY


def test_bench_serve_quick_json(tmp_path):
    # About a minute (66-78s with the machine's load average at 11-14): 4 fronts, 5 workers.
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "bench", "serve", "--quick", "--json",
                          "--dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["kind"] == "serve" and report["quick"] is True and report["ok"] is True
    assert report["concurrency"] == list(QUICK_CONCURRENCY)
    top = str(max(QUICK_CONCURRENCY))
    assert report["ratios_at_concurrency"] == int(top)
    fronts = report["fronts"]
    assert fronts["resident"]["device_budget_bytes"] >= fronts["resident"]["model_bytes"]
    assert fronts["offloaded"]["device_budget_bytes"] < fronts["offloaded"]["model_bytes"]
    assert fronts["generate"]["device_budget_bytes"] < fronts["generate"]["model_bytes"]
    assert fronts["hints"]["counters"]["hints_sent"] > 0
    for section, modes in (("infer", INFER_MODES), ("generate", GENERATE_MODES)):
        assert set(report[section]) == set(modes)
        for mode in modes:
            assert set(report[section][mode]) == {str(c) for c in QUICK_CONCURRENCY}
            for c, phase in report[section][mode].items():
                where = (section, mode, c)
                assert phase["requests"] > 0 and phase["completed"] == phase["requests"], where
                assert phase["errors"] == 0, (where, [r["errors"] for r in phase["runs"]])
                assert phase["rps"] > 0 and 0 < phase["p50_seconds"] <= phase["p99_seconds"], where
                if mode.endswith("_unbatched"):
                    assert phase["mean_batch_size"] == 1, where
                if section == "generate":
                    assert phase["tokens_per_second"] > 0, where
                    assert all(r["tokens"] == r["completed"] * report["lm"]["max_new_tokens"]
                               for r in phase["runs"]), where
    # At the top concurrency with batching on, the front really joins requests.
    assert report["infer"]["offloaded_batched"][top]["mean_batch_size"] > 1
    assert report["generate"]["offloaded_batched"][top]["mean_batch_size"] > 1
    for mode in ("hints", "no_hints"):
        (phase,) = report["hints"][mode].values()
        assert phase["completed"] == phase["requests"] > 0 and phase["errors"] == 0
    assert set(report["ratios"]) >= {"offloaded_over_resident_batched",
                                     "batched_over_unbatched_offloaded",
                                     "generate_tokens_batched_over_unbatched",
                                     "hints_over_no_hints_rps"}
    assert all(v is not None and v > 0 for v in report["ratios"].values()), report["ratios"]
    assert set(report["targets"]) == {"offloaded_over_resident_batched",
                                      "batched_over_unbatched_offloaded"}
