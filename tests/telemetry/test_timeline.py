"""prefetchd.telemetry.timeline: the Chrome trace it writes (valid JSON, named tracks, spans
on the tracks they occupied), the ring bound, the cost when tracing is off, the
where-the-time-went breakdown, compute spans ended by a real compute fence, and
(once the daemon records into it) the trace of a real demo run."""
import json
import sys
import time
import timeit

import numpy as np
import pytest

from prefetchd.telemetry import timeline as tlm
from prefetchd.telemetry.timeline import (COMPUTE, DISK_READS, DISK_WRITES, KIND_TRACKS, LOAD_STREAM, SCHEDULER,
                                          STORE_STREAM, TRACKS, NullTimeline, Timeline)
from prefetchd.telemetry.timeline_report import breakdown, plot, spans, summarize

MS = 1_000_000


def _load(path):
    with open(path) as f:
        return json.load(f)


def _track_names(doc):
    return {e["tid"]: e["args"]["name"] for e in doc["traceEvents"]
            if e["ph"] == "M" and e["name"] == "thread_name"}


def test_writer_produces_chrome_trace_json_with_one_named_track_each(tmp_path):
    tl = Timeline(tmp_path / "t.json")
    t0 = time.monotonic_ns()
    tl.transfer("load", "blocks.0.qkv.weight", 3 << 20, t0, t0 + 4 * MS)
    tl.transfer("store", "blocks.1.up.weight", 1 << 20, t0 + 1 * MS, t0 + 3 * MS)
    tl.compute_begin("blocks.0")
    tl.compute_end("blocks.0")
    tl.stall("blocks.0.qkv.weight", t0, t0 + 2 * MS)
    tl.eviction("blocks.2.up.weight", 4096, "watermark")
    tl.decision("load", "blocks.3.up.weight", 8192, source="remote")
    tl.device_bytes(12345)
    assert tl.close() == str(tmp_path / "t.json")

    doc = _load(tmp_path / "t.json")
    assert doc["displayTimeUnit"] == "ms" and doc["otherData"]["clock"] == "CLOCK_MONOTONIC"
    names = _track_names(doc)
    assert sorted(names.values()) == sorted(TRACKS) and len(set(names)) == len(TRACKS)
    events = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    assert {e["ph"] for e in events} == {"X", "i", "C"}
    for e in events:
        assert names[e["tid"]] == e["cat"]            # each event sits on the track it names
        assert e["ts"] >= 0 and e["pid"] == doc["traceEvents"][0]["pid"]
    by_track = {}
    for e in events:
        if e["ph"] == "X":
            by_track.setdefault(names[e["tid"]], []).append(e)
    # A load occupied the load stream and the disk; a store the store stream and the disk.
    assert [e["args"]["tensor"] for e in by_track[LOAD_STREAM]] == ["blocks.0.qkv.weight"]
    assert [e["args"]["tensor"] for e in by_track[DISK_READS]] == ["blocks.0.qkv.weight"]
    assert [e["args"]["tensor"] for e in by_track[STORE_STREAM]] == ["blocks.1.up.weight"]
    assert [e["args"]["tensor"] for e in by_track[DISK_WRITES]] == ["blocks.1.up.weight"]
    assert by_track[LOAD_STREAM][0]["args"]["bytes"] == 3 << 20
    assert by_track[LOAD_STREAM][0]["dur"] == pytest.approx(4000.0)          # microseconds
    assert by_track[STORE_STREAM][0]["ts"] - by_track[LOAD_STREAM][0]["ts"] == pytest.approx(1000.0)
    assert [e["name"] for e in by_track[COMPUTE]] == ["blocks.0"]
    assert [e["name"] for e in by_track[SCHEDULER]] == ["stall"]
    evict = next(e for e in events if e["ph"] == "i" and e["name"].startswith("evict"))
    assert names[evict["tid"]] == SCHEDULER and evict["args"] == {
        "tensor": "blocks.2.up.weight", "bytes": 4096, "reason": "watermark"}
    (counter,) = [e for e in events if e["ph"] == "C"]
    assert counter["args"] == {"device bytes": 12345}


@pytest.mark.parametrize("kind", sorted(KIND_TRACKS))
def test_each_transfer_kind_lands_on_its_tracks_only(kind):
    tl = Timeline()
    tl.transfer(kind, "w", 10, 100, 200)
    got = {track for track, v in spans(tl).items() if v}
    assert got == set(KIND_TRACKS[kind])


def test_bad_input_is_refused_by_name(tmp_path):
    tl = Timeline()
    with pytest.raises(ValueError, match="'teleport'"):
        tl.transfer("teleport", "w", 1, 0, 1)
    with pytest.raises(ValueError, match="capacity"):
        Timeline(capacity=0)
    with pytest.raises(TypeError, match="trace"):
        Timeline.from_config(42)
    with pytest.raises(ValueError, match="no path"):
        Timeline().write()


def test_ring_keeps_the_newest_events_up_to_its_capacity(tmp_path):
    tl = Timeline(tmp_path / "ring.json", capacity=50)
    for i in range(500):
        tl.span(COMPUTE, f"u{i}", i * 1000, i * 1000 + 500)
    assert len(tl) == 50 and tl.dropped == 450
    tl.close()
    doc = _load(tmp_path / "ring.json")
    kept = [e["name"] for e in doc["traceEvents"] if e["ph"] == "X"]
    assert kept == [f"u{i}" for i in range(450, 500)]
    assert doc["otherData"]["events_dropped"] == 450 and doc["otherData"]["capacity"] == 50


def test_null_timeline_records_nothing_and_costs_little(tmp_path, monkeypatch):
    monkeypatch.delenv(tlm.ENV_VAR, raising=False)
    null = Timeline.from_config(None)
    assert type(null) is NullTimeline and not null.enabled
    null.transfer("load", "w", 1, 0, 1)
    null.compute_begin("u")
    null.compute_end("u")
    assert len(null) == 0 and null.write() is None and null.close() is None

    n = 200_000
    call = null.transfer
    off = min(timeit.repeat(lambda: call("load", "w", 4096, 1, 2), number=n, repeat=3)) / n
    on_tl = Timeline(capacity=1000)
    call_on = on_tl.transfer
    on = min(timeit.repeat(lambda: call_on("load", "w", 4096, 1, 2), number=n, repeat=3)) / n
    print(f"\nNullTimeline.transfer: {off * 1e9:.0f} ns/op; Timeline.transfer: {on * 1e9:.0f} ns/op")
    assert off < 1e-6, f"a disabled timeline costs {off * 1e9:.0f} ns per call"
    assert off < on    # doing nothing is cheaper than recording


def test_from_config_takes_a_path_the_env_true_or_a_timeline(tmp_path, monkeypatch):
    monkeypatch.setenv(tlm.ENV_VAR, str(tmp_path / "env.json"))
    from_env = Timeline.from_config(None)
    assert from_env.enabled and from_env.path == str(tmp_path / "env.json")
    explicit = Timeline.from_config(tmp_path / "arg.json")
    assert explicit.path == str(tmp_path / "arg.json")
    in_memory = Timeline.from_config(True)
    assert in_memory.enabled and in_memory.path is None and in_memory.close() is None
    assert Timeline.from_config(explicit) is explicit
    monkeypatch.delenv(tlm.ENV_VAR)
    assert not Timeline.from_config(False).enabled


def _special_files(tmp_path):
    """A FIFO, a character device (a private /dev/null: major 1, minor 3), a socket and a
    directory: what a trace path must never replace."""
    import os
    import socket
    import stat
    os.mkfifo(tmp_path / "fifo")
    os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "sock"))
    (tmp_path / "dir").mkdir()
    os.symlink(tmp_path / "null", tmp_path / "link-to-null")
    return listener, ["fifo", "null", "sock", "dir", "link-to-null"]   # (the link: refused as a link)


@pytest.mark.skipif(sys.platform != "linux" or __import__("os").geteuid() != 0, reason="mknod needs root")
def test_a_trace_path_that_is_no_regular_file_is_refused_before_the_run_and_left_as_it_was(tmp_path,
                                                                                            monkeypatch):
    import os
    import stat

    import prefetchd
    from prefetchd.errors import ConfigError
    listener, names = _special_files(tmp_path)
    modes = {n: os.lstat(tmp_path / n).st_mode for n in names}
    with listener:
        for name in names:
            with pytest.raises(ConfigError, match=r"^trace: .* is a .*not a regular file"):
                Timeline.from_config(tmp_path / name)
            monkeypatch.setenv(tlm.ENV_VAR, str(tmp_path / name))      # as PREFETCHD_TRACE=...
            with pytest.raises(ConfigError, match="not a regular file"):
                prefetchd.Daemon(device_budget="1MiB", store_dir=str(tmp_path / "store"))
            monkeypatch.delenv(tlm.ENV_VAR)
            tl = Timeline(None)
            with pytest.raises(ValueError, match="not a regular file"):
                tl.write(tmp_path / name)             # a path changed after the check: still refused
        with pytest.raises(ConfigError, match="directory .* does not exist"):
            Timeline.from_config(tmp_path / "missing" / "t.json")
    assert {n: os.lstat(tmp_path / n).st_mode for n in names} == modes
    assert stat.S_ISCHR(os.stat(tmp_path / "null").st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)    # no PATH.tmpPID left


def test_a_trace_path_that_is_a_symlink_is_refused_and_neither_the_link_nor_its_file_changes(tmp_path):
    # Followed, another user's link in a shared /tmp made root overwrite the file it named.
    import os
    from prefetchd.errors import ConfigError
    victim = tmp_path / "victim.conf"
    victim.write_text("keep")
    os.chmod(victim, 0o600)
    os.symlink(victim, tmp_path / "trace.json")
    with pytest.raises(ConfigError, match="is a symlink, not a regular file"):
        Timeline.from_config(tmp_path / "trace.json")
    with pytest.raises(ValueError, match="is a symlink"):
        Timeline(None).write(tmp_path / "trace.json")
    assert victim.read_text() == "keep" and os.stat(victim).st_mode & 0o777 == 0o600
    assert os.readlink(tmp_path / "trace.json") == str(victim)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json", "victim.conf"]
    tl = Timeline.from_config(tmp_path / "new.json")     # a plain new file is written, readable
    tl.close()
    assert "traceEvents" in _load(tmp_path / "new.json") and os.stat(tmp_path / "new.json").st_mode & 0o777 == 0o644


def test_breakdown_measures_busy_time_stalls_and_overlap():
    tl = Timeline()
    tl.span(COMPUTE, "u0", 0, 10 * MS)
    tl.span(COMPUTE, "u1", 20 * MS, 30 * MS)
    tl.transfer("load", "a", 1 << 20, 5 * MS, 15 * MS)
    tl.transfer("load", "b", 1 << 20, 12 * MS, 25 * MS)     # overlaps a: busy is the union
    tl.transfer("d2h", "c", 4096, 40 * MS, 42 * MS)
    tl.stall("u1", 10 * MS, 20 * MS)
    tl.decision("load", "b", 1 << 20)                     # instants take no time
    b = breakdown(tl)
    assert b["wall"] == pytest.approx(0.042)
    assert b["compute"] == pytest.approx(0.020) and b["compute_spans"] == 2
    assert b["stall"] == pytest.approx(0.010)
    assert b["tracks"][LOAD_STREAM] == {"busy": pytest.approx(0.020), "spans": 2, "bytes": 2 << 20}
    assert b["tracks"][DISK_READS]["busy"] == pytest.approx(0.020)
    assert b["tracks"][STORE_STREAM] == {"busy": pytest.approx(0.002), "spans": 1, "bytes": 4096}
    assert b["copy"] == pytest.approx(0.022)
    # load copy 5..25 ms meets compute 5..10 and 20..25
    assert b["copy_overlapping_compute"] == pytest.approx(0.010)
    table = summarize(tl)
    for needle in ("compute", "0.020 s", "stall", "0.010 s", LOAD_STREAM, "2.0 MiB", "(45%)"):
        assert needle in table, (needle, table)

    # From 20 ms on: spans clipped there, transfers that ended before left out.
    late = breakdown(tl, since_ns=20 * MS)
    assert late["wall"] == pytest.approx(0.022) and late["compute"] == pytest.approx(0.010)
    assert late["stall"] == 0 and late["compute_spans"] == 1
    assert late["tracks"][LOAD_STREAM] == {"busy": pytest.approx(0.005), "spans": 1, "bytes": 1 << 20}
    assert late["copy_overlapping_compute"] == pytest.approx(0.005)
    assert "passes 2-3" in summarize(tl, 20 * MS, what="passes 2-3")


def test_a_written_trace_reads_back_to_the_same_breakdown(tmp_path):
    tl = Timeline(tmp_path / "rt.json")
    t0 = time.monotonic_ns()
    tl.span(COMPUTE, "u0", t0, t0 + 7 * MS)
    tl.transfer("load", "a", 123, t0 + 3 * MS, t0 + 9 * MS)
    tl.stall("a", t0 + 9 * MS, t0 + 10 * MS)
    tl.close()
    from_file, live = breakdown(str(tmp_path / "rt.json")), breakdown(tl)
    for key in ("wall", "compute", "stall", "copy", "copy_overlapping_compute"):
        assert from_file[key] == pytest.approx(live[key], abs=1e-9), key
    assert from_file["tracks"][LOAD_STREAM]["bytes"] == 123


def test_compute_spans_end_at_the_real_compute_fence(ms):
    """A unit's kernels run after its post-hook returns: the span ends when MindSpore
    reaches the fence behind them, stamped by the observer thread."""
    from prefetchd.backend.framework import ComputeMarker
    marker = ComputeMarker()
    tl = Timeline()
    x = ms.Tensor(np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32))
    returned = []
    for i in range(3):
        tl.compute_begin(f"u{i}")
        y = x
        for _ in range(20):
            y = ms.ops.matmul(y, x) * 1e-3
        epoch = marker.mark(y)
        returned.append(time.monotonic_ns())
        tl.compute_end(f"u{i}", marker, epoch)
    y.asnumpy()
    tl.close()
    compute = spans(tl)[COMPUTE]
    assert [name for _, _, name, _ in compute] == ["u0", "u1", "u2"]
    assert all(args["fenced"] for *_, args in compute)
    for (s, e, _, _), (s2, _, _, _) in zip(compute, compute[1:]):
        assert s <= e <= s2                 # one executor: spans in order, never overlapping
    # The last unit's fence is reached no earlier than its hook returned.
    assert compute[-1][1] >= returned[-1]


def test_native_completions_use_the_same_clock():
    """The native engine stamps completions with CLOCK_MONOTONIC: time.monotonic_ns()."""
    from prefetchd import _native
    src, dst = np.ones(1 << 20, np.uint8), np.zeros(1 << 20, np.uint8)
    stream = _native.Stream("clock")
    try:
        before = time.monotonic_ns()
        event = stream.copy(dst, src)
        assert event.synchronize(10)
        after = time.monotonic_ns()
    finally:
        stream.close()
    assert before <= event.start_ns <= event.end_ns <= after


def test_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)     # import fails as if not installed
    tl = Timeline()
    tl.span(COMPUTE, "u", 0, 1)
    with pytest.raises(ImportError, match=r"prefetchd\[plot\]"):
        plot(tl, tmp_path / "t.png")


def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    tl = Timeline()
    tl.span(COMPUTE, "u", 0, 5 * MS)
    tl.transfer("load", "w", 10, 1 * MS, 3 * MS)
    out = plot(tl, tmp_path / "t.png")
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_trace_of_a_real_demo_run_shows_copies_overlapping_compute(tmp_path):
    from prefetchd.demo.run import run_demo
    trace = tmp_path / "demo.json"
    rc = run_demo(size=48 << 20, hidden=512, passes=2, trace=str(trace), quiet=True)
    assert rc == 0
    doc = _load(trace)
    names = _track_names(doc)
    assert sorted(names.values()) == sorted(TRACKS)
    by_track = spans(str(trace))
    assert by_track[COMPUTE], "no compute spans"
    assert by_track[LOAD_STREAM], "no copy spans"
    assert by_track[DISK_READS], "no disk read spans"
    assert {e["tid"] for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == COMPUTE} != \
        {e["tid"] for e in doc["traceEvents"] if e["ph"] == "X" and e["cat"] == LOAD_STREAM}
    # Prefetch at work: weights stream in while earlier units compute.
    assert breakdown(str(trace))["copy_overlapping_compute"] > 0


def test_compute_after_close_ends_at_once_without_a_thread(ms):
    from prefetchd.backend.framework import ComputeMarker
    marker = ComputeMarker()
    tl = Timeline()
    tl.close()
    tl.compute_begin("late")
    tl.compute_end("late", marker, marker.mark(ms.Tensor(np.zeros(4, np.float32))))
    (span,) = spans(tl)[COMPUTE]
    assert span[2] == "late" and span[3]["fenced"] is False
    assert tl._observer is None
