"""What `prefetchd bench serve --quick --json` must report, checked on the README's own run of
it (tests/cli/test_readme_commands.py: one run, ~75-155 s, was two): the report's structure,
and that every phase answered every request with its own rows (correctness, not speed: the
quick model is tiny); and in the shared_host section, what a shared host tier must do even
at the quick size: its workers read nothing from the store while measured, and the front
reads less in total than the private host tiers of the same run (the owner reads each tensor
once)."""
import statistics

import pytest

from prefetchd.bench.serve import GENERATE_MODES, INFER_MODES, QUICK_CONCURRENCY


def check_quick_report(report):
    """The parsed JSON of `prefetchd bench serve --quick --json` (see the module docstring)."""
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
    _check_shared_host(report["shared_host"])


def _check_shared_host(section):
    from prefetchd.bench.serve_shared import QUICK, ROLES
    assert section["ok"] is True and section["same_reply"] is True
    assert section["workers"] == QUICK["workers"] and set(section["fronts"]) == set(ROLES)
    assert section["device_budget_bytes"] < section["model"]["bytes"] <= section["host_budget_bytes"]
    fronts = section["fronts"]
    for role, front in fronts.items():
        assert front["requests"] > 0 and front["completed"] == front["requests"], role
        assert front["errors"] == 0 and not front["workers_replaced"], role
        assert front["rps"] > 0 and 0 < front["p50_seconds"] <= front["p99_seconds"], role
        assert len(front["worker_pids"]) == QUICK["workers"], role
        assert len(front["disk"]["workers_read_bytes_total"]) == QUICK["workers"], role
        assert all(p > 0 for p in front["host_ram"]["workers_pss_bytes"]), role
        # Workers compute every request: some CPU in every phase, per request the median.
        assert all(r["workers_cpu_seconds"] > 0 for r in front["runs"]), role
        assert front["workers_cpu_seconds_per_request"] == pytest.approx(statistics.median(
            r["workers_cpu_seconds"] / r["completed"] for r in front["runs"])), role
    shared, private = fronts["shared"], fronts["private"]
    model = section["model"]["bytes"]
    # The shared front's workers never read the store while measured; its owner read each
    # tensor once (fills), and it holds the model once, in the owner's segments.
    assert shared["disk"]["workers_read_bytes_measured"] == [0] * QUICK["workers"]
    assert shared["disk"]["owner_fill_bytes"] == model
    assert shared["shared"]["counters"]["fills"] == shared["shared"]["blocks"]
    assert shared["shared"]["worker_fallbacks"] == [0] * QUICK["workers"]
    assert all(h > 0 for h in shared["shared"]["worker_hits"])
    assert shared["host_ram"]["shared_segment_bytes"] >= model
    assert shared["workers_host_used_bytes"] == [0] * QUICK["workers"]
    # Private host tiers: a copy per worker, each read from the store.
    assert private["disk"]["owner_fill_bytes"] is None and private["shared"] is None
    assert private["host_tier_bytes"] >= QUICK["workers"] * model
    assert sum(private["disk"]["workers_read_bytes_total"]) >= QUICK["workers"] * model
    assert shared["disk"]["front_read_bytes_total"] < private["disk"]["front_read_bytes_total"]
    assert shared["host_tier_bytes"] < private["host_tier_bytes"]
    ratios = section["ratios"]
    assert set(ratios) == {"disk_bytes_shared_over_private", "host_ram_shared_over_private",
                           "rps_shared_over_private"}
    assert all(v is not None and v > 0 for v in ratios.values()), ratios
    assert ratios["disk_bytes_shared_over_private"] < 1
    paired = section["rps_shared_over_private_paired"]
    assert paired["rounds"] == section["repeats"]
    assert paired["range"][0] <= paired["median"] <= paired["range"][1]
    runs = [f["runs"] for f in (shared, private)]
    assert paired["median"] == pytest.approx(statistics.median(
        s["rps"] / p["rps"] for s, p in zip(*runs)))
    cpu = section["workers_cpu_per_request_shared_over_private_paired"]
    assert cpu["rounds"] == section["repeats"] and cpu["range"][0] <= cpu["median"] <= cpu["range"][1]
    assert section["shmem_huge_pages"] in (None, "never", "advise", "always", "within_size", "deny", "force")
    assert set(section["targets"]) == {"shared_rps_not_worse"}
