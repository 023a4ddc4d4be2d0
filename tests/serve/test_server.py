"""`prefetchd serve`: a front and spawned workers running the demo model with
their own daemons. Routing, status aggregation, prefetch hints, a worker killed
mid-request, request timeouts, bounded close, the CLI and the load generator.

Workers take a few seconds to start (each imports MindSpore), so one front
serves most tests; the model is tiny.
"""
import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from helpers import wait_until as _wait_until
from prefetchd.control import Client, RequestTimeout, ServiceError
from prefetchd.control import protocol as P
from prefetchd.serve import Front, ServeSpec



def wait_until(predicate, timeout=30.0, interval=0.05):
    return _wait_until(predicate, timeout, interval)


SPEC = dict(models=2, hidden=64, layers=2, batch=2, seq=8, lookahead=1)




@pytest.fixture(scope="module")
def front(tmp_path_factory):
    spec = ServeSpec(store_dir=str(tmp_path_factory.mktemp("serve-store")), **SPEC)
    f = Front(f"ipc://serve-test-{os.getpid()}-{secrets.token_hex(2)}.sock", workers=2, spec=spec,
              request_timeout=20.0, name=f"st{os.getpid()}", metrics_port=0).start()
    yield f
    f.close(10)


@pytest.fixture
def client(front):
    with Client(front.endpoint, timeout=20) as c:
        yield c


def _worker_status(client):
    return {w["index"]: w for w in client.status()["workers"]}


def test_infer_answers_with_the_model_it_was_asked_for(client):
    first = client.call("infer", model="m0", seed=1)
    again = client.call("infer", model="m0", seed=1)
    other = client.call("infer", model="m1", seed=1)
    assert first["model"] == "m0" and other["model"] == "m1"
    assert first["worker"] in (0, 1) and first["pid"] != os.getpid()
    assert first["checksum"] == pytest.approx(again["checksum"], rel=1e-4, abs=1e-4)
    assert first["checksum"] != pytest.approx(other["checksum"], rel=1e-3)
    assert first["seconds"] >= first["compute_seconds"] > 0


def test_status_aggregates_the_workers(client, front):
    st = client.status()
    assert st["front"]["models"] == ["m0", "m1"]
    assert [w["index"] for w in st["workers"]] == [0, 1]
    for w in st["workers"]:
        assert w["ready"] and w["pid"] and w["daemon"]["name"] == f"worker-{w['index']}"
        assert w["daemon"]["tensors"] > 0
        assert w["daemon"]["server"]["endpoint"] == w["control"]
    assert st["total"]["tensors"] == sum(w["daemon"]["tensors"] for w in st["workers"])
    assert client.ping()["workers"] == 2


def test_hint_prefetches_the_next_model_on_the_worker(client, front):
    # A sequential client keeps landing on the same worker; alternate models to force switches.
    client.call("infer", model="m0", hint=False)
    sent = front.counters["hints_sent"]
    r = client.call("infer", model="m1", hint=True)
    assert r["hinted"] is True
    assert front.counters["hints_sent"] == sent + 1                    # one hint per switch
    assert wait_until(lambda: front.counters["hints_ok"] >= front.counters["hints_sent"], 5)
    with Client(_worker_status(client)[r["worker"]]["control"], timeout=5) as worker:
        prefetches = worker.stats()["stats"]["requests"]["prefetch"]
    assert prefetches["issued"] + prefetches["hit"] > 0
    r = client.call("infer", model="m0", hint=False)
    assert r["hinted"] is False
    assert client.call("infer", model="m0", hint=True)["hinted"] is False   # no switch, no hint


def test_front_exports_its_own_and_all_workers_metrics(client, front):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    client.call("infer", model="m0")
    url = f"http://127.0.0.1:{front.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    used = {s.labels["daemon"] for s in fams["prefetchd_device_memory_used_bytes"].samples}
    assert used == {"worker-0", "worker-1"}
    assert all(s.value == 1 for s in fams["prefetchd_serve_worker_up"].samples)
    assert fams["prefetchd_serve_requests"].samples[0].value >= 1
    assert any(s.labels.get("outcome") == "sent" for s in fams["prefetchd_serve_hints"].samples)
    assert text.count("# TYPE prefetchd_device_memory_used_bytes ") == 1   # merged, not repeated


def test_worker_config_owns_nothing_public(tmp_path, monkeypatch):
    from prefetchd.serve import worker_config
    cfg = tmp_path / "p.toml"
    cfg.write_text('[prefetchd]\ndevice_budget = "64MiB"\nendpoint = "ipc://x.sock"\n'
                   'metrics_port = 9466\npolicy = "belady"\n[serve]\nworkers = 3\n')
    spec = ServeSpec(config_path=str(cfg), **SPEC)
    c = worker_config(spec, 1, str(tmp_path / "w1"))
    assert (c.endpoint, c.metrics_port, c.policy, c.name) == (None, None, "lru", "worker-1")
    assert c.device_budget == 64 << 20 and c.store_dir == str(tmp_path / "w1")
    spec = ServeSpec(config_path=str(cfg), budget=2.0, **SPEC)
    assert worker_config(spec, 0, str(tmp_path)).device_budget == spec.device_budget()
    monkeypatch.setenv("PREFETCHD_METRICS_PORT", "9500")
    assert worker_config(spec, 0, str(tmp_path)).metrics_port is None


def test_bad_requests_get_errors(client, front):
    with pytest.raises(ServiceError) as err:
        client.call("infer", model="nope")
    assert err.value.code == P.BAD_REQUEST
    with pytest.raises(ServiceError):
        client.call("infer", model="m0", delay=-1)
    with pytest.raises(ServiceError):
        client.call("launch")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(front.endpoint)
        sock.send_multipart([b"PFD7", b"12345678", b"{}"])
        assert sock.poll(5000)
        rid, doc = P.decode_reply(sock.recv_multipart())
        assert doc["code"] == P.UNSUPPORTED_VERSION
    finally:
        ctx.destroy(linger=0)
    assert client.ping()["pong"]


def test_request_timeout_is_reported(client, front):
    started = time.monotonic()
    with pytest.raises(RequestTimeout) as err:
        client.call("infer", model="m0", delay=2.5, timeout=1.0)
    assert err.value.code == P.TIMEOUT and "did not complete" in str(err.value)
    assert time.monotonic() - started < 1.5
    assert client.call("infer", model="m1")["model"] == "m1"      # the other worker serves


def test_killed_worker_fails_its_request_and_is_replaced(client, front):
    assert wait_until(lambda: all(w["inflight"] == 0 for w in _worker_status(client).values()), 10)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(front.endpoint)
        sock.send_multipart(P.encode_request(b"slowslow", "infer", {"model": "m0", "delay": 30}))
        busy = []
        assert wait_until(lambda: busy.extend(w for w in _worker_status(client).values()
                                              if w["inflight"]) or busy, 10)
        victim = busy[0]
        os.kill(victim["pid"], signal.SIGKILL)
        killed = time.monotonic()
        assert sock.poll(10_000), "the front did not answer for the dead worker"
        rid, doc = P.decode_reply(sock.recv_multipart())
        assert time.monotonic() - killed < 5
        assert rid == b"slowslow" and doc["code"] == P.INTERNAL and "died" in doc["reason"]
        assert "signal 9" in doc["reason"]
    finally:
        ctx.destroy(linger=0)
    assert client.call("infer", model="m1")["model"] == "m1"     # served while it respawns
    assert wait_until(lambda: (lambda w: w["ready"] and w["generation"] == victim["generation"] + 1
                               and w["pid"] != victim["pid"])(_worker_status(client)[victim["index"]]),
                      60)
    assert front.counters["worker_deaths"] >= 1
    results = {client.call("infer", model=m)["model"] for m in ("m0", "m1", "m0", "m1")}
    assert results == {"m0", "m1"}


def test_zz_close_is_bounded_and_leaves_nothing(front):
    pids = [pid for _, pid, _ in front.workers()]
    files = front.socket_files
    started = time.monotonic()
    front.close(10)
    assert time.monotonic() - started < 10
    assert all(pid and not os.path.exists(f"/proc/{pid}") for pid in pids)   # exited and reaped
    assert not [t for t in threading.enumerate() if t.name.startswith("prefetchd-front")]
    assert not any(os.path.exists(f) for f in files)
    with Client(front.endpoint, timeout=0.3) as c:
        with pytest.raises(RequestTimeout):
            c.ping()


def test_bench_serve_reports_both_modes(tmp_path):
    from prefetchd.bench.serve import bench_serve
    args = argparse.Namespace(workers=1, hidden=64, layers=2, requests=6, repeats=1, budget=0.5,
                              lookahead=1, dir=str(tmp_path), json=True)
    result = bench_serve(args)
    json.dumps(result)
    assert result["ok"], result
    for mode in ("hints", "no_hints"):
        assert result[mode]["rps"] > 0
        assert 0 < result[mode]["p50_seconds"] <= result[mode]["p99_seconds"]
    assert result["front"]["hints_sent"] > 0
    assert set(result["ratios"]) == {"rps", "p50", "p99"}


def test_cli_serve_and_status(tmp_path):
    endpoint = f"ipc://cli-serve-{os.getpid()}.sock"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))] + sys.path))
    cmd = [sys.executable, "-m", "prefetchd.cli", "serve", "--endpoint", endpoint, "--workers", "1",
           "--hidden", "64", "--layers", "2", "--store", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with Client(endpoint, timeout=1) as c:
            def up():
                try:
                    return c.ping()["workers"] == 1
                except RequestTimeout:
                    return False
            assert wait_until(up, 90, 0.2), proc.stderr.read1().decode() if proc.poll() else ""
            assert c.call("infer", model="m1", timeout=30)["model"] == "m1"
        out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "status", "--endpoint", endpoint],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "serve front" in out.stdout and "worker 0" in out.stdout
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_serve_options_flags_over_file_over_defaults(tmp_path, monkeypatch):
    from prefetchd.errors import ConfigError
    from prefetchd.cli.serve import register, serve_options
    monkeypatch.delenv("PREFETCHD_CONFIG", raising=False)
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    cfg = tmp_path / "serve.toml"
    cfg.write_text('[prefetchd]\nname = "x"\n[serve]\nworkers = 3\nhidden = 128\nhints = false\n')
    o = serve_options(parser.parse_args(["serve", "--config", str(cfg), "--hidden", "64"]))
    assert (o["workers"], o["hidden"], o["hints"], o["layers"]) == (3, 64, False, 4)
    o = serve_options(parser.parse_args(["serve"]))
    assert (o["workers"], o["hints"], o["config"]) == (2, True, None)
    cfg.write_text('[prefetchd]\n[serve]\nwrokers = 3\n')
    with pytest.raises(ConfigError, match="wrokers"):
        serve_options(parser.parse_args(["serve", "--config", str(cfg)]))
