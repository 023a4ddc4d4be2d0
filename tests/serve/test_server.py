"""`prefetchd serve`: a front and spawned workers running the demo model with
their own daemons. Routing, status aggregation, prefetch hints, metrics, bounded
close and the CLI (`bench serve`: tests/_bench_serve_report.py, on the README's run). Tensors,
batching and hostile requests are tests/serve/test_requests.py; timeouts, deaths
and hangs test_workers.py.

Workers take a few seconds to start (each imports MindSpore), so one front
serves most tests; the model is tiny.
"""
import argparse
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq

from helpers import children_of, running, wait_until as _wait_until
import numpy as np

from prefetchd.control import Client, RequestTimeout, ServiceError
from prefetchd.control import protocol as P
from prefetchd.serve import Front, ServeSpec
from prefetchd.serve import Client as ServeClient
from prefetchd.serve.spec import demo_model



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


@pytest.fixture
def infer(front):
    """infer(model, x) -> (outputs, reply) through a prefetchd.serve.Client."""
    with ServeClient(front.endpoint, timeout=20) as c:
        def call(model, x, **kw):
            f = c.submit(model, x, **kw)
            return f.result(30), f.reply
        yield call


def _x(seed, batch=2):
    return np.random.default_rng(seed).standard_normal((batch, SPEC["seq"], SPEC["hidden"])) \
        .astype(np.float32)


def _worker_status(client):
    return {w["index"]: w for w in client.status()["workers"]}


def test_infer_answers_with_the_model_it_was_asked_for(infer):
    import mindspore as ms
    spec = ServeSpec(**SPEC)
    x = _x(1)
    (first,), r = infer("m0", x)
    (other,), r1 = infer("m1", x)
    assert r["model"] == "m0" and r1["model"] == "m1"
    assert r["worker"] in (0, 1) and r["pid"] != os.getpid()
    assert r["seconds"] >= r["compute_seconds"] > 0
    for i, got in enumerate((first, other)):         # m<i> is built with seed spec.seed + i
        cell, _ = demo_model(seed=spec.seed + i, spec=spec)
        assert np.array_equal(got, cell(ms.Tensor(x)).asnumpy())   # the resident model, bit-equal
    assert not np.allclose(first, other)


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


def _infer_json(client):
    """infer through the control Client (a JSON-only client): the reply document only."""
    x = _x(0)

    def call(model, **kw):
        with ServeClient(client.endpoint, timeout=20) as c:
            f = c.submit(model, x, **kw)
            f.result(30)
            return f.reply
    return call


def test_hint_prefetches_the_next_model_on_the_worker(client, front):
    # A sequential client keeps landing on the same worker; alternate models to force switches.
    infer = _infer_json(client)
    infer("m0", hint=False)
    sent = front.counters["hints_sent"]
    r = infer("m1", hint=True)
    assert r["hinted"] is True
    assert front.counters["hints_sent"] == sent + 1                    # one hint per switch
    assert wait_until(lambda: front.counters["hints_ok"] >= front.counters["hints_sent"], 5)
    with Client(_worker_status(client)[r["worker"]]["control"], timeout=5) as worker:
        prefetches = worker.stats()["stats"]["requests"]["prefetch"]
    assert prefetches["issued"] + prefetches["hit"] > 0
    r = infer("m0", hint=False)
    assert r["hinted"] is False
    assert infer("m0", hint=True)["hinted"] is False   # no switch, no hint


def test_front_exports_its_own_and_all_workers_metrics(client, front):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    _infer_json(client)("m0")
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
    with pytest.raises(ServiceError, match="needs 'inputs'"):
        client.call("infer", model="m0")
    with pytest.raises(ServiceError, match="unknown argument 'seed'"):
        client.call("infer", model="m0", seed=1)          # the old seeded form is gone: refused
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


def test_a_second_front_on_the_same_store_is_refused_and_the_first_serves_on(front, infer):
    """Worker stores are named by index and generation: a second server on one --store took the
    first one's and removed a directory its worker was reading (outside probe)."""
    from prefetchd.config import ConfigError
    second = Front(f"ipc://second-{os.getpid()}-{secrets.token_hex(2)}.sock", workers=1, spec=front.spec,
                   name=f"second{os.getpid()}")
    with pytest.raises(ConfigError, match=rf"in use by another prefetchd serve \(pid {os.getpid()}\)"):
        second.start()
    assert not second.running
    for model in ("m0", "m1"):
        (y,), _ = infer(model, _x(1))
        assert y.shape[0] == 2


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


def test_cli_serve_and_status(tmp_path):
    endpoint = f"ipc://cli-serve-{os.getpid()}.sock"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))] + sys.path))
    cmd = [sys.executable, "-m", "prefetchd.cli", "serve", "--endpoint", endpoint, "--workers", "1",
           "--hidden", "64", "--layers", "2", "--seq", "8", "--store", str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with Client(endpoint, timeout=1) as c:
            def up():
                try:
                    return c.ping()["workers"] == 1
                except RequestTimeout:
                    return False
            assert wait_until(up, 90, 0.2), proc.stderr.read1().decode() if proc.poll() else ""
            with ServeClient(endpoint, timeout=30) as sc:
                (y,) = sc.infer("m1", _x(0))
            assert y.shape[0] == 2
        np.save(tmp_path / "x.npy", _x(0))
        out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "infer", "--endpoint", endpoint,
                              "--model", "m1", str(tmp_path / "x.npy"), "--out", str(tmp_path / "o")],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split("\t")[0] == str(tmp_path / "o" / "output0.npy")
        assert np.array_equal(np.load(tmp_path / "o" / "output0.npy"), y)
        np.save(tmp_path / "bad.npy", np.array([object()]), allow_pickle=True)
        out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "infer", "--endpoint", endpoint,
                              "--model", "m1", str(tmp_path / "bad.npy")],
                             env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and "not a readable .npy" in out.stderr
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


def _serve_env(*paths):
    """The environment of a `prefetchd serve` subprocess that imports tests/serve's models."""
    serve_dir = os.path.dirname(os.path.abspath(__file__))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(serve_dir)), serve_dir, *paths] + sys.path))


def _serve_cmd(name, model, store):
    return [sys.executable, "-m", "prefetchd.cli", "serve", "--endpoint", f"ipc://{name}-{os.getpid()}.sock",
            "--workers", "1", "--model", model, "--model-bytes", "1000000", "--store", str(store)]


def test_a_signal_while_workers_start_stops_the_server_at_once(tmp_path):
    """SIGTERM while the workers are still building their models: the server stops at once,
    not after start_timeout (180 s) with 'workers not ready'."""
    env = _serve_env()
    cmd = _serve_cmd("slow", "_servables:slow_to_build", tmp_path)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: any(d.startswith("worker-") for d in os.listdir(tmp_path)), 60, 0.1)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        code = proc.wait(30)
        # A worker still starting is sent SIGTERM at once (0.3 s here); it sat out the 3 s
        # grace a ready worker gets after STOP, which it never got (5.1 s for an outside probe).
        assert time.monotonic() - started < 2.5, proc.stderr.read()
        assert code == 0, proc.stderr.read()
        # The worker exited before its daemon closed: the front removed its socket files.
        from prefetchd.control.endpoints import runtime_dir
        assert not [f for f in os.listdir(runtime_dir()) if f.startswith(f"serve-{proc.pid}-")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("after", [0.0, 0.5])
def test_ctrl_c_while_the_cli_imports_the_model_exits_cleanly(tmp_path, after):
    """SIGINT while `serve` imported --model (and MindSpore) raised KeyboardInterrupt inside
    that import and aborted the process ("Fatal Python error", rc -6; outside probe). The
    model module marks the moment its import starts: a fixed delay from launch landed
    before it on a loaded machine (in the CLI's own imports: exit 130, not this case)."""
    mark = tmp_path / "importing"
    (tmp_path / "msmodel.py").write_text(f"open({str(mark)!r}, 'w').close()\n"
                                         "import mindspore  # noqa: F401  (what a model module does)\n"
                                         "from _servables import sleepy as build  # noqa: F401\n")
    env = _serve_env(str(tmp_path))
    cmd = _serve_cmd("ctrlc", "msmodel:build", tmp_path / "s")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert _wait_until(mark.exists, 60, 0.01), proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(after)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(60)
        err = proc.stderr.read()
        assert code == 0 and "Fatal Python error" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_a_worker_still_building_exits_when_its_front_is_killed(tmp_path):
    """The worker watched for its front only once ready: one inside a slow factory outlived a
    SIGKILLed front (for ever if the factory blocks), holding its store (outside probe)."""
    env = _serve_env()
    cmd = _serve_cmd("orphan", "_servables:slow_to_build", tmp_path)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert wait_until(lambda: any(d.startswith("worker-") for d in os.listdir(tmp_path)), 60, 0.1)
        workers = children_of(proc.pid)
        assert workers
        proc.kill()
        proc.wait(5)
        assert wait_until(lambda: not any(map(running, workers)), 10, 0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("factory, says", [
    ("raises", "RuntimeError: factory of seed 0 failed on purpose"),
    ("exits", "SystemExit: no such checkpoint for seed 0")])
def test_a_factory_that_fails_is_one_line_naming_its_error(tmp_path, factory, says):
    """Each worker's traceback went to stderr at each of its three tries, and the error said
    only 'no worker could be started'; a sys.exit printed its message three times (outside
    probe)."""
    env = _serve_env()
    out = subprocess.run(_serve_cmd("fails", f"_servables:{factory}", tmp_path / "s"),
                         env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 1
    assert "Traceback" not in out.stderr and out.stderr.count("seed 0") == 1, out.stderr
    assert f"no worker could be started: worker 0: {says}" in out.stderr.splitlines()[-1]


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
    # The metrics address: flag > [serve] > the daemons' own setting (env or [prefetchd]) >
    # loopback (the daemons' setting was ignored, so a pod's metrics were unreachable).
    monkeypatch.setenv("PREFETCHD_METRICS_ADDR", "0.0.0.0")
    assert serve_options(parser.parse_args(["serve"]))["metrics_addr"] == "0.0.0.0"
    assert serve_options(parser.parse_args(["serve", "--metrics-addr", "127.0.0.2"]))["metrics_addr"] == "127.0.0.2"
    cfg.write_text('[serve]\nmetrics_addr = "127.0.0.3"\n')
    assert serve_options(parser.parse_args(["serve", "--config", str(cfg)]))["metrics_addr"] == "127.0.0.3"
    monkeypatch.delenv("PREFETCHD_METRICS_ADDR")
    cfg.write_text('[prefetchd]\nmetrics_addr = "0.0.0.0"\n')
    assert serve_options(parser.parse_args(["serve", "--config", str(cfg)]))["metrics_addr"] == "0.0.0.0"
    assert serve_options(parser.parse_args(["serve"]))["metrics_addr"] == "127.0.0.1"
    # So are the exporter's port and the front's endpoint (they were dropped without a word).
    monkeypatch.setenv("PREFETCHD_METRICS_PORT", "19470")
    monkeypatch.setenv("PREFETCHD_ENDPOINT", "ipc://from-env.sock")
    o = serve_options(parser.parse_args(["serve"]))
    assert (o["metrics_port"], o["endpoint"]) == (19470, "ipc://from-env.sock")
    o = serve_options(parser.parse_args(["serve", "--metrics-port", "19471", "--endpoint", "ipc://flag.sock"]))
    assert (o["metrics_port"], o["endpoint"]) == (19471, "ipc://flag.sock")
    monkeypatch.delenv("PREFETCHD_METRICS_PORT")
    monkeypatch.delenv("PREFETCHD_ENDPOINT")
    cfg.write_text('[prefetchd]\nmetrics_port = 19472\n')
    assert serve_options(parser.parse_args(["serve", "--config", str(cfg)]))["metrics_port"] == 19472
    assert serve_options(parser.parse_args(["serve"]))["metrics_port"] is None
    cfg.write_text('[prefetchd]\n[serve]\nwrokers = 3\n')
    with pytest.raises(ConfigError, match="wrokers"):
        serve_options(parser.parse_args(["serve", "--config", str(cfg)]))
    # Every value is checked as its flag is, naming the key and the file (they went unchecked).
    for line, words in [('workers = "two"', "workers .*'two' is not an integer"),
                        ("workers = 1.5", "workers .*'1.5' is not an integer"),
                        ("workers = 0", "workers .*must be >= 1"),
                        ("heartbeat_timeout = 0", "heartbeat_timeout .*seconds must be > 0"),
                        ("request_timeout = -1", "request_timeout .*seconds must be > 0"),
                        ("max_queue_delay_ms = -5", "max_queue_delay_ms .*milliseconds from 0"),
                        ('hints = "no"', "hints .*expected true or false"),
                        ("models = 0", "models .*must be >= 1"),
                        ("metrics_port = 70000", "metrics_port .*out of range"),
                        ("endpoint = 5", "endpoint .*expected a string"),
                        ('model = ""', "model .*empty"),
                        ("workers = true", "workers .*expected a value like the flag's")]:
        cfg.write_text(f"[serve]\n{line}\n")
        with pytest.raises(ConfigError, match=rf"\[serve\] {words}") as refused:
            serve_options(parser.parse_args(["serve", "--config", str(cfg)]))
        assert str(cfg) in str(refused.value)


def test_a_worker_in_the_middle_of_a_job_exits_soon_after_its_front_is_killed(tmp_path):
    """A ready worker looked for its front only between jobs: one inside a long forward (a
    generate) ran on for nobody for tens of seconds after a SIGKILLed front, holding its
    store, so a front restarted meanwhile found that store in use (outside probe)."""
    from helpers import start_serve
    endpoint = f"ipc://{tmp_path}/midjob.sock"
    proc = start_serve(endpoint, ["--model", "_servables:sleepy", "--model-bytes", "1000000",
                                  "--store", str(tmp_path / "store")], _serve_env())
    try:
        workers = children_of(proc.pid)
        with ServeClient(endpoint, timeout=60) as c:
            pending = c.submit("m0", np.full((1, 4), 25.0, np.float32))     # a 25 s forward
            time.sleep(2.0)
            assert not pending.done()
            proc.kill()
            proc.wait(5)
            killed = time.monotonic()
            assert wait_until(lambda: not any(map(running, workers)), 20, 0.1)
            assert time.monotonic() - killed < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_a_front_held_up_longer_than_the_heartbeat_timeout_keeps_its_workers(tmp_path):
    """The front counted the time its own loop was held up (a message of six million frames
    took 35 s to receive) as its workers' silence, and killed both healthy workers: here the
    front is stopped (SIGSTOP) for twice the timeout instead."""
    from helpers import start_serve, stop_serve
    endpoint = f"ipc://{tmp_path}/held.sock"
    proc = start_serve(endpoint, ["--hidden", "32", "--layers", "2", "--batch", "2", "--seq", "4",
                                  "--heartbeat-timeout", "3", "--store", str(tmp_path / "store")], _serve_env())
    try:
        proc.send_signal(signal.SIGSTOP)
        time.sleep(6.0)
        proc.send_signal(signal.SIGCONT)
        time.sleep(2.0)                                   # its timers ran again: none found hung
        with Client(endpoint, timeout=10) as c:
            (worker,) = c.status()["workers"]
        assert worker["generation"] == 1 and worker["deaths"] == 0, worker
        with ServeClient(endpoint, timeout=30) as c:
            (y,) = c.infer("m0", np.ones((2, 4, 32), np.float32))
        assert np.isfinite(y).all()
    finally:
        proc.send_signal(signal.SIGCONT)
        assert stop_serve(proc) == 0
