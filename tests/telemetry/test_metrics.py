"""prefetchd.telemetry.metrics: exposition names, types and labels; values that follow the
daemon's work; per-daemon registries; the HTTP exporter's lifecycle; and the
dashboard/alert files only referring to metrics that exist."""
import gzip
import importlib.metadata
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

import prefetchd
from prefetchd.telemetry import metrics
from prefetchd.telemetry.stats import SECONDS_BUCKETS, SIZE_BUCKETS, Stats

ms = pytest.importorskip("mindspore")

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "prefetchd.json"
ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"

KiB = 1 << 10
TENSOR_BYTES = 64 * KiB
NAME_RE = re.compile(r"^prefetchd_[a-z0-9_]+$")
UNIT_SUFFIXES = ("_bytes", "_seconds", "_ratio", "_info", "_total", "_depth", "_tensors",
                 "_in_flight")


PROCESS = {"process_cpu_seconds", "process_open_fds", "process_max_fds", "process_resident_memory_bytes",
           "process_virtual_memory_bytes", "process_start_time_seconds"}


def parse(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def ours(families):
    """The daemon's own families (the standard process_* ones are checked on their own)."""
    return {n: f for n, f in families.items() if not n.startswith("process_")}


def value(families, family, **labels):
    """The one sample of `family` (counter families are named without _total) matching labels."""
    fam = families[family]
    suffix = "_total" if fam.type == "counter" else ""
    hits = [s for s in fam.samples if s.name == family + suffix
            and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (family, labels, hits)
    return hits[0].value


def hist(families, family, **labels):
    """(cumulative buckets {le: count}, count, sum) of one histogram series."""
    fam = families[family]
    match = [s for s in fam.samples if all(s.labels.get(k) == v for k, v in labels.items())]
    buckets = {s.labels["le"]: s.value for s in match if s.name.endswith("_bucket")}
    count = [s.value for s in match if s.name.endswith("_count")]
    total = [s.value for s in match if s.name.endswith("_sum")]
    assert len(count) == 1 and len(total) == 1, (family, labels)
    return buckets, count[0], total[0]


def tensor(i, nbytes=TENSOR_BYTES):
    return ms.Tensor(np.full((nbytes // 4,), float(i), dtype=np.float32))


@pytest.fixture
def daemon(make_daemon):
    return make_daemon(device_budget=256 * KiB, name="m1")


def register_remote(d, count, prefix="model.layer"):
    return [d.register(tensor(i), name=f"{prefix}{i}.weight", tier="remote") for i in range(count)]


# ---------------------------------------------------------------------------------- names and types

def test_every_declared_metric_is_exposed_with_its_type(daemon):
    fams = parse(metrics.render(daemon))
    for name, (kind, _doc, _labels) in metrics.METRICS.items():
        assert name in fams, name
        assert fams[name].type == kind, name
    assert set(fams) == set(metrics.METRICS) | PROCESS
    # Transfer seconds are the duration histogram's _sum, not a second counter.
    assert "prefetchd_transfer_seconds" not in fams


def test_process_metrics_describe_this_process(daemon):
    import os
    import resource
    fams = parse(metrics.render(daemon))
    assert fams["process_cpu_seconds"].type == "counter"
    (fds,) = fams["process_open_fds"].samples
    assert abs(fds.value - len(os.listdir("/proc/self/fd"))) <= 3
    (max_fds,) = fams["process_max_fds"].samples
    assert max_fds.value == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    (rss,) = fams["process_resident_memory_bytes"].samples
    assert rss.value > 10 << 20


def test_names_follow_prometheus_conventions(daemon):
    register_remote(daemon, 2)
    text = metrics.render(daemon)
    assert ":" not in "".join(line.split("{")[0] for line in text.splitlines() if not line.startswith("#"))
    for fam in ours(parse(text)).values():
        assert NAME_RE.match(fam.name), fam.name
        assert fam.documentation, fam.name
        assert not re.search(r"_(ms|milliseconds|kib|mib|gib|kb|mb|percent|perc)(_|$)", fam.name), fam.name
        if fam.type == "counter":
            assert all(s.name == fam.name + "_total" for s in fam.samples), fam.name
            assert not fam.name.endswith("_total")  # no `..._total_total`
        else:
            assert "_total" not in fam.name, fam.name
            if fam.type == "gauge":
                assert fam.name.endswith(UNIT_SUFFIXES) or fam.name == "prefetchd_tensors", fam.name
        if fam.type == "histogram":
            assert fam.name.endswith(("_bytes", "_seconds")), fam.name


def test_labels_are_bounded_and_carry_the_daemon(daemon):
    handles = register_remote(daemon, 3, prefix="secret_tensor_")
    daemon.prefetch(handles).result(timeout=30)
    fams = ours(parse(metrics.render(daemon)))
    tensor_names = {h.name for h in handles}
    for name, fam in fams.items():
        allowed = {"daemon", *metrics.METRICS[name][2]}
        for s in fam.samples:
            extra = {"le"} if fam.type == "histogram" and s.name.endswith("_bucket") else set()
            assert set(s.labels) == allowed | extra, (s.name, s.labels)
            assert s.labels["daemon"] == "m1"
            for v in s.labels.values():
                assert "secret_tensor_" not in v and v not in tensor_names, (s.name, s.labels)
    assert {s.labels["direction"] for s in fams["prefetchd_transfer_bytes"].samples} == \
        {"load", "store", "h2d", "d2h"}
    assert {s.labels["level"] for s in fams["prefetchd_device_memory_watermark_bytes"].samples} == \
        {"high", "low"}
    assert {s.labels["state"] for s in fams["prefetchd_tensors"].samples} >= \
        {"absent", "loading", "resident", "storing"}
    outcomes = {s.labels["outcome"] for s in fams["prefetchd_requests"].samples}
    assert outcomes >= {"hit", "miss", "issued", "failed"}


def test_histograms_are_cumulative_with_the_stats_buckets(daemon):
    daemon.prefetch(register_remote(daemon, 2)).result(timeout=30)
    fams = parse(metrics.render(daemon))
    for family, bounds in (("prefetchd_transfer_size_bytes", SIZE_BUCKETS),
                           ("prefetchd_transfer_duration_seconds", SECONDS_BUCKETS)):
        for direction in ("load", "store", "h2d", "d2h"):
            buckets, count, _ = hist(fams, family, direction=direction)
            les = [float(le) for le in buckets]
            assert les == [*map(float, bounds), float("inf")]
            counts = [buckets[le] for le in buckets]
            assert counts == sorted(counts) and counts[-1] == count
    for family in ("prefetchd_queue_wait_seconds", "prefetchd_stall_seconds"):
        buckets, count, _ = hist(fams, family)
        assert [float(le) for le in buckets] == [*SECONDS_BUCKETS, float("inf")]
        assert buckets["+Inf"] == count


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=8 << 30), max_size=40))
def test_bucket_conversion_matches_observations(sizes):
    stats = Stats()
    for n in sizes:
        stats.record_transfer("load", n, 0.001)
    status = {"name": "h", "backend": "cpu", "io_engine": "buffered",
              "device": {"capacity": 1, "used": 0, "peak": 0, "high_watermark": 1, "low_watermark": 0,
                         "usage_ratio": 0.0},
              "host": {"budget": 0, "used": 0}, "remote": {"bytes": 0}, "queue_depth": 0,
              "in_flight": 0, "pinned": 0, "pinned_bytes": 0, "tensors": 0, "states": {}}
    fam = {f.name: f for f in metrics.DaemonCollector.families(status, stats)}["prefetchd_transfer_size_bytes"]
    for s in fam.samples:
        if s.labels["direction"] != "load":
            continue
        if s.name.endswith("_bucket"):
            assert s.value == sum(1 for n in sizes if n <= float(s.labels["le"]))
        elif s.name.endswith("_sum"):
            assert s.value == sum(sizes)
        elif s.name.endswith("_count"):
            assert s.value == len(sizes)


def test_info_metrics(daemon):
    fams = parse(metrics.render(daemon))
    (build,) = fams["prefetchd_build_info"].samples
    assert build.value == 1
    assert build.labels["version"] == prefetchd.__version__
    assert build.labels["mindspore_version"] == importlib.metadata.version("mindspore")
    assert build.labels["native"]
    (engine,) = fams["prefetchd_io_engine_info"].samples
    assert engine.value == 1 and engine.labels["engine"] == daemon.status()["io_engine"]
    assert engine.labels["engine"] in ("aio", "threads", "buffered", "io_uring")


# ---------------------------------------------------------------------------------- values move

def test_bytes_loaded_equal_bytes_read_from_the_store(daemon):
    loaded = []
    daemon.add_listener(lambda e: loaded.append(e["nbytes"]) if e["event"] == "loaded" else None)
    handles = register_remote(daemon, 3)
    before = parse(metrics.render(daemon))
    assert value(before, "prefetchd_transfer_bytes", direction="load") == 0
    assert value(before, "prefetchd_transfer_bytes", direction="store") == 3 * TENSOR_BYTES
    assert value(before, "prefetchd_tensors", state="absent") == 3

    started = time.monotonic()
    daemon.prefetch(handles).result(timeout=30)
    elapsed = time.monotonic() - started
    fams = parse(metrics.render(daemon))
    read_from_store = sum(h.nbytes for h in handles)
    assert read_from_store == sum(loaded) == 3 * TENSOR_BYTES
    assert value(fams, "prefetchd_transfer_bytes", direction="load") == read_from_store
    assert value(fams, "prefetchd_device_load_bytes", source="remote") == read_from_store
    _, count, total = hist(fams, "prefetchd_transfer_size_bytes", direction="load")
    assert (count, total) == (3, read_from_store)
    _, dcount, dsum = hist(fams, "prefetchd_transfer_duration_seconds", direction="load")
    # The seconds spent loading: the histogram's _sum (no separate counter). One load
    # stream runs them in turn, so they fit inside the time the prefetch took.
    assert dcount == 3 and 0 < dsum <= elapsed
    assert dsum == pytest.approx(daemon.snapshot()[1].transfer_duration["load"].sum)
    assert value(fams, "prefetchd_tensors", state="resident") == 3
    status = daemon.status()
    assert value(fams, "prefetchd_device_memory_used_bytes", device="cpu") == status["device"]["used"] > 0
    assert value(fams, "prefetchd_requests", op="prefetch", outcome="issued") >= 1
    assert value(fams, "prefetchd_remote_stored_bytes") >= read_from_store

    # Evict and load again: the counters add up, the gauges go down and up.
    daemon.evict(handles).result(timeout=30)
    fams = parse(metrics.render(daemon))
    assert value(fams, "prefetchd_evictions", reason="explicit") == 3
    assert value(fams, "prefetchd_tensors", state="absent") == 3
    assert value(fams, "prefetchd_device_memory_used_bytes", device="cpu") == 0
    daemon.prefetch(handles).result(timeout=30)
    daemon.prefetch(handles).result(timeout=30)   # all resident: a hit
    fams = parse(metrics.render(daemon))
    # The reload came from the store again or from the host cache: either way the
    # bytes into the device add up, and only the store's share was read from disk.
    from_remote = value(fams, "prefetchd_device_load_bytes", source="remote")
    from_host = value(fams, "prefetchd_device_load_bytes", source="host")
    assert from_remote + from_host == 2 * read_from_store == sum(loaded)
    assert value(fams, "prefetchd_device_loads", source="remote") * TENSOR_BYTES == from_remote
    assert value(fams, "prefetchd_device_loads", source="host") * TENSOR_BYTES == from_host
    assert value(fams, "prefetchd_transfer_bytes", direction="load") == from_remote >= read_from_store
    assert value(fams, "prefetchd_requests", op="prefetch", outcome="hit") >= 1
    _, qcount, _ = hist(fams, "prefetchd_queue_wait_seconds")
    assert qcount >= 3


def test_watermark_gauges_and_evictions_under_pressure(daemon):
    handles = register_remote(daemon, 8)              # 512 KiB through a 256 KiB device tier
    for h in handles:                                 # compute uses each in turn: demand loads
        with daemon.use(h):
            pass
    fams = parse(metrics.render(daemon))
    high = value(fams, "prefetchd_device_memory_watermark_bytes", device="cpu", level="high")
    low = value(fams, "prefetchd_device_memory_watermark_bytes", device="cpu", level="low")
    cap = value(fams, "prefetchd_device_memory_capacity_bytes", device="cpu")
    used = value(fams, "prefetchd_device_memory_used_bytes", device="cpu")
    peak = value(fams, "prefetchd_device_memory_peak_bytes", device="cpu")
    assert cap == 256 * KiB and low <= high <= cap
    assert used <= peak <= high
    assert value(fams, "prefetchd_device_memory_usage_ratio", device="cpu") == pytest.approx(used / cap)
    assert value(fams, "prefetchd_evictions", reason="watermark") >= 4
    assert value(fams, "prefetchd_transfer_bytes", direction="load") == 8 * TENSOR_BYTES

    daemon.set_watermarks(0.5, 0.25).result(timeout=30)
    fams = parse(metrics.render(daemon))
    assert value(fams, "prefetchd_device_memory_watermark_bytes", device="cpu", level="high") == 128 * KiB
    assert value(fams, "prefetchd_device_memory_used_bytes", device="cpu") <= 128 * KiB


def test_pinned_gauges(daemon):
    handles = register_remote(daemon, 2)
    with daemon.use(handles[0]):
        fams = parse(metrics.render(daemon))
        assert value(fams, "prefetchd_pinned_tensors") == 1
        assert value(fams, "prefetchd_pinned_bytes") == TENSOR_BYTES
        assert value(fams, "prefetchd_requests", op="fetch", outcome="miss") >= 1
    daemon.flush().result(timeout=30)   # the unpin went through the queue before this resolves
    fams = parse(metrics.render(daemon))
    assert value(fams, "prefetchd_pinned_tensors") == 0


def test_an_evict_of_a_pinned_tensor_is_counted_refused_not_failed(daemon):
    # An operator's `ctl evict` of a pinned tensor counted as a failed request, which
    # PrefetchdRequestsFailing watches: one refused evict on a quiet daemon sent it pending.
    handles = register_remote(daemon, 1)
    with daemon.use(handles[0]):
        with pytest.raises(prefetchd.PinnedError, match="pinned"):
            daemon.evict(handles).result(timeout=30)
    fams = parse(metrics.render(daemon))
    assert value(fams, "prefetchd_requests", op="evict", outcome="refused") == 1
    assert value(fams, "prefetchd_requests", op="evict", outcome="failed") == 0


def test_one_snapshot_per_scrape(daemon):
    calls = []
    real = daemon.snapshot

    def counting():
        calls.append(threading.current_thread().name)
        return real()
    daemon.snapshot = counting
    metrics.render(daemon)
    assert len(calls) == 1
    # Scraping does not grow with the work done: no per-request objects are kept.
    handles = register_remote(daemon, 2)
    for _ in range(50):
        daemon.prefetch(handles).result(timeout=30)
    assert len(metrics.render(daemon)) < 64 * KiB
    assert len(calls) == 2


# ---------------------------------------------------------------------------------- exporter

def _scrape(url):
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def _port_is_free(port):
    """Nothing listens there: a server may bind it (SO_REUSEADDR, as HTTP servers do, so
    the TIME_WAIT left by a scrape does not count)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_daemon_exporter_serves_and_close_frees_port_and_thread(tmp_path):
    d = prefetchd.Daemon(device_budget=256 * KiB, store_dir=str(tmp_path), name="web", metrics_port=0)
    d.start()
    try:
        port = d.metrics_port
        assert port and not _port_is_free(port)
        fams = parse(_scrape(f"http://127.0.0.1:{port}/metrics"))
        assert value(fams, "prefetchd_queue_depth") == 0
        assert fams["prefetchd_build_info"].samples[0].labels["daemon"] == "web"
        assert any(t.name.startswith("prefetchd-metrics") for t in threading.enumerate())
    finally:
        d.close()
    assert _port_is_free(port)
    assert not any(t.name.startswith("prefetchd-metrics") and t.is_alive() for t in threading.enumerate())
    with pytest.raises(urllib.error.URLError):
        _scrape(f"http://127.0.0.1:{port}/metrics")
    d.close()   # idempotent


def test_start_exporter_direct(daemon):
    exporter = metrics.start_exporter(daemon, "127.0.0.1", 0)
    try:
        assert exporter.port > 0 and exporter.url == f"http://127.0.0.1:{exporter.port}/metrics"
        assert exporter.addr == "127.0.0.1"
        assert "prefetchd_device_memory_used_bytes" in _scrape(exporter.url)
        assert "prefetchd_device_memory_used_bytes" in \
            metrics.generate_latest(exporter.registry).decode()
    finally:
        exporter.close()
    exporter.close()
    assert exporter.closed and not exporter._thread.is_alive()
    assert _port_is_free(exporter.port)
    with metrics.start_exporter(daemon, "127.0.0.1", exporter.port) as again:   # same port, at once
        assert again.port == exporter.port
        assert "prefetchd_queue_depth" in _scrape(again.url)
    assert again.closed


# An exporter in its own process with a low file-descriptor limit, as a
# deployment with `ulimit -n 256` would run it.
IDLE_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
import prefetchd
d = prefetchd.Daemon(device_budget=1 << 20, store_dir=sys.argv[1], metrics_port=0, name="idle").start()
print(d.metrics_port, flush=True)
sys.stdin.readline()
d.close()
"""


def _fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_idle_connections_are_bounded_and_a_scrape_still_succeeds(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", IDLE_CHILD, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    idle = []
    try:
        port = int(child.stdout.readline())
        url = f"http://127.0.0.1:{port}/metrics"
        assert "prefetchd_queue_depth" in _scrape(url)
        baseline = _fds(child.pid)
        for _ in range(1000):            # four times the child's fd limit, all idle
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)                  # let the exporter accept what it will
        for _ in range(3):
            started = time.monotonic()
            with urllib.request.urlopen(url, timeout=1) as r:
                assert r.status == 200 and b"prefetchd_queue_depth" in r.read()
            assert time.monotonic() - started < 1.0
        assert child.poll() is None
        # Accepted sockets never exceed the cap: fds stay bounded, not 1000 more.
        assert _fds(child.pid) <= baseline + 64 + 2, (baseline, _fds(child.pid))
    finally:
        for s in idle:
            s.close()
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(30)
    assert child.returncode == 0


def test_an_idle_connection_is_closed_after_the_timeout(daemon):
    with metrics.start_exporter(daemon, "127.0.0.1", 0, timeout=0.3) as exporter:
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as s:
            started = time.monotonic()
            assert s.recv(1) == b""           # the server hung up on us
            assert 0.2 < time.monotonic() - started < 3.0
        # a slow client that sent half a request is closed the same way
        with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            assert s.recv(1) == b""
        assert "prefetchd_queue_depth" in _scrape(exporter.url)


def _raw(port, request):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(request)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return head.decode("latin-1"), body


def test_exporter_speaks_http_as_prometheus_expects(daemon):
    with metrics.start_exporter(daemon, "127.0.0.1", 0) as exporter:
        port = exporter.port
        head, body = _raw(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n")
        assert head.startswith("HTTP/1.1 200") and "Content-Encoding: gzip" in head
        assert b"prefetchd_queue_depth" in gzip.decompress(body)
        head, body = _raw(port, b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text; "
                                b"version=1.0.0\r\n\r\n")
        assert "application/openmetrics-text" in head and body.rstrip().endswith(b"# EOF")
        head, body = _raw(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
        assert head.startswith("HTTP/1.1 200") and body == b""
        assert _raw(port, b"POST /metrics HTTP/1.1\r\n\r\n")[0].startswith("HTTP/1.1 405")
        assert _raw(port, b"GET /secrets HTTP/1.1\r\n\r\n")[0].startswith("HTTP/1.1 404")
        assert _raw(port, b"garbage\r\n\r\n")[0].startswith("HTTP/1.1 400")
        assert _raw(port, b"GET /" + b"a" * (20 << 10))[0].startswith("HTTP/1.1 431")


def test_a_non_loopback_address_is_logged_loudly(daemon, caplog):
    with caplog.at_level(logging.WARNING, logger="prefetchd.metrics"):
        with metrics.start_exporter(daemon, "127.0.0.1", 0):
            pass
        assert not caplog.records
        with metrics.start_exporter(daemon, "0.0.0.0", 0) as exporter:
            assert "prefetchd_queue_depth" in _scrape(f"http://127.0.0.1:{exporter.port}/metrics")
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "0.0.0.0" in record.getMessage() and "NOT loopback" in record.getMessage()


def test_two_daemons_in_one_process_do_not_collide(tmp_path):
    a = prefetchd.Daemon(device_budget=256 * KiB, store_dir=str(tmp_path / "a"), name="alpha", metrics_port=0)
    b = prefetchd.Daemon(device_budget=512 * KiB, store_dir=str(tmp_path / "b"), name="beta", metrics_port=0)
    with a, b:
        assert a.metrics_port != b.metrics_port
        a.prefetch(register_remote(a, 2)).result(timeout=30)
        fa = parse(_scrape(f"http://127.0.0.1:{a.metrics_port}/metrics"))
        fb = parse(_scrape(f"http://127.0.0.1:{b.metrics_port}/metrics"))
        for fams, name in ((fa, "alpha"), (fb, "beta")):
            assert {s.labels["daemon"] for f in ours(fams).values() for s in f.samples} == {name}
        assert value(fa, "prefetchd_transfer_bytes", direction="load") == 2 * TENSOR_BYTES
        assert value(fb, "prefetchd_transfer_bytes", direction="load") == 0
        assert value(fa, "prefetchd_device_memory_capacity_bytes", device="cpu") == 256 * KiB
        assert value(fb, "prefetchd_device_memory_capacity_bytes", device="cpu") == 512 * KiB
        # render() builds its own registry each time: no global state, no duplicate errors.
        assert parse(metrics.render(a)).keys() == parse(metrics.render(b)).keys()


# ---------------------------------------------------------------------------------- dashboard, alerts

def _dashboard_panels(dash):
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def _metric_names(expr):
    names = set(re.findall(r"\bprefetchd_[a-z0-9_]+", expr))
    return {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in names}


def test_dashboard_is_raw_provisionable_json():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["id"] is None and dash["uid"] == "prefetchd-main" and dash["schemaVersion"] == 39
    assert "__inputs" not in dash and "${DS_" not in DASHBOARD.read_text()
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["instance"]["definition"].startswith("label_values(")
    assert variables["instance"]["definition"].endswith(", instance)")
    stats = [p["title"] for p in dash["panels"] if p["type"] == "stat" and p["gridPos"]["y"] == 0]
    assert len(stats) == 5
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert rows == ["Memory per tier", "Transfers", "Requests and errors", "Serving"]
    assert any(p["type"] == "heatmap" for p in dash["panels"])
    ids = [p["id"] for p in _dashboard_panels(dash)]
    assert len(ids) == len(set(ids))


@pytest.fixture(scope="module")
def front_families(tmp_path_factory):
    """The families a real `prefetchd serve` front exports (its own and its worker's),
    scraped over HTTP after requests for two models went through it."""
    import secrets

    from prefetchd.serve import Client, Front, ServeSpec

    spec = ServeSpec(models=2, hidden=32, layers=2, seq=4, lookahead=1,
                     store_dir=str(tmp_path_factory.mktemp("front-store")))
    front = Front(f"ipc://dash-{os.getpid()}-{secrets.token_hex(2)}.sock", workers=1, spec=spec,
                  name=f"dash{os.getpid()}", metrics_port=0).start()
    try:
        x = np.zeros((1, 4, 32), np.float32)
        with Client(front.endpoint, timeout=60) as c:
            for model in ("m0", "m1"):
                c.infer(model, x)
        url = f"http://127.0.0.1:{front.metrics_port}/metrics"
        return parse(urllib.request.urlopen(url, timeout=10).read().decode())
    finally:
        front.close(10)


def test_front_exports_batch_size_and_queue_time_per_model(front_families):
    for family in ("prefetchd_serve_batch_size", "prefetchd_serve_queue_seconds"):
        assert front_families[family].type == "histogram"
        for model in ("m0", "m1"):
            buckets, count, _ = hist(front_families, family, model=model)
            assert count >= 1 and buckets["+Inf"] == count, (family, model)
    buckets, _, total = hist(front_families, "prefetchd_serve_batch_size", model="m0")
    assert total >= 1 and buckets["1.0"] >= 1          # one request alone: a batch of 1 row


def test_the_deploy_readme_says_which_series_carry_a_daemon_label(front_families):
    """A front's scrape: every worker daemon's series has `daemon`, the front's own
    (prefetchd_serve_*) have none, and deploy/README.md says so (it said every metric had one)."""
    without = {n for n, f in ours(front_families).items() if any("daemon" not in x.labels for x in f.samples)}
    assert without and all(n.startswith(("prefetchd_serve_", "prefetchd_shared_host_")) for n in without), without
    assert any(not n.startswith("prefetchd_serve_") for n in ours(front_families))      # the workers'
    text = " ".join((ROOT / "deploy" / "README.md").read_text().split())
    assert "and carry a `daemon` label" not in text
    assert "A serve front's own series carry none" in text and "`prefetchd_serve_*`" in text


def test_dashboard_panels_name_their_metrics_which_exist(daemon, front_families):
    """Every panel's metrics exist: a daemon's exporter for the daemon panels, a `prefetchd
    serve` front's (prefetchd_serve_*) for the serving ones."""
    exposed = set(parse(metrics.render(daemon))) | set(front_families)
    dash = json.loads(DASHBOARD.read_text())
    for p in _dashboard_panels(dash):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        used = set()
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            expr = t["expr"]
            if "rate(" in expr or "increase(" in expr:
                assert all(w == "$__rate_interval" for w in re.findall(r"\[([^\]]+)\]", expr)), expr
            assert 'instance=~"$instance"' in expr, expr
            used |= _metric_names(expr)
        assert used and used <= exposed, (p["title"], used - exposed)
        for name in used:
            assert name in p["description"], (p["title"], name)


def test_alert_rules_refer_to_exposed_metrics(daemon, front_families):
    exposed = set(parse(metrics.render(daemon))) | set(front_families)      # a daemon's, a serve front's
    exprs = re.findall(r"^\s*expr:\s*(.+)$", ALERTS.read_text(), re.M)
    alerts = re.findall(r"^\s*- alert:\s*(\S+)", ALERTS.read_text(), re.M)
    assert len(exprs) == len(alerts) >= 5
    assert {"PrefetchdWatermarkBreached", "PrefetchdSustainedStalls", "PrefetchdChecksumFailures",
            "PrefetchdIOErrors", "PrefetchdExporterDown", "PrefetchdServeWorkerDown"} <= set(alerts)
    for expr in exprs:
        assert _metric_names(expr) <= exposed, expr
