"""A short run of `prefetchd bench soak`: mixed load with faults, ending with nothing lost or leaked."""
from prefetchd.bench import soak


def test_short_soak_loses_nothing_and_leaks_nothing(tmp_path):
    report = soak.run(str(tmp_path), seconds=20, fault_every=0.3)
    assert report["data_mismatches"] == 0, report
    assert report["watermark_violations"] == 0, report
    assert not report["hung_threads"], report
    assert not report["crashed_threads"], report   # every worker kept adding load to the end
    assert report["operations_total"] > 200, report
    assert report["operations"].get("forward", 0) > 3, report
    assert report["remote_client"] == "ok", report
    assert report["fds_after"] <= report["fds_before"], report
    assert report["threads_after"] <= report["threads_before"], report
    # injected faults surfaced as precise errors, not as garbage or hangs (a flush whose
    # write-backs failed raises FlushError, the StorageError naming every one of them)
    assert set(report["errors_by_kind"]) <= {"StorageError", "FlushError", "IntegrityError", "BudgetError",
                                             "PinnedError", "ServiceError", "PrefetchdError"}, report
    # a second process on the same store is kept out; listener exceptions did not stop the scheduler
    assert report["second_process"].get("refused", 0) >= 1 and set(report["second_process"]) == {"refused"}
    assert report["operations"].get("listener_raised", 0) > 0, report
    assert report["ok"], report
