"""`prefetchd serve --shared-host`: the front owns one host tier and four workers
attach to it, in real processes: each tensor is read from the store once in total,
answers equal the staged weights', a worker SIGKILLed under load leaks no lease
and its respawn and the survivors keep serving."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import start_serve, wait_until
from prefetchd.control import Client
from prefetchd.serve.spec import ServeSpec, demo_model
from prefetchd.serve import Client as ServeClient

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(hidden=128, layers=4, batch=2, seq=8)
WORKERS = 4


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + sys.path))


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    import mindspore as ms
    d = tmp_path_factory.mktemp("shared-ckpt")
    spec = ServeSpec(models=1, **SMALL)
    cell, signature = demo_model(seed=5, spec=spec)
    ckpt = str(d / "model.ckpt")
    ms.save_checkpoint(cell, ckpt)
    (shape, dtype), = signature
    inputs = {seed: np.random.default_rng(seed + 1).standard_normal(shape).astype(dtype) for seed in range(4)}
    want = {seed: (x, cell(ms.Tensor(x)).asnumpy()) for seed, x in inputs.items()}
    store = str(d / "store")
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "stage", ckpt, "--store", store,
                          "--quiet"], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    params = list(cell.get_parameters())
    return {"store": store, "want": want, "params": len(params),
            "bytes": sum(int(np.prod(p.shape)) * 4 for p in params)}


def _infer_all(endpoint, want, rounds):
    with ServeClient(endpoint, timeout=120) as client:
        for r in range(rounds):
            for seed, (x, expected) in want.items():
                got, = client.infer("m0", x)
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"round {r}, input {seed}")


def _leases_match(doc):
    owner = {w["pid"]: w["leases"] for w in doc["front"]["shared_host"]["workers"]}
    mapped = {w["pid"]: w["daemon"]["shared_host"]["mapped_leases"] for w in doc["workers"]}
    return owner == mapped and doc["front"]["shared_host"]["leases"] == sum(mapped.values())


def test_four_workers_share_one_host_tier(staged):
    endpoint = f"ipc://shared-serve-{os.getpid()}.sock"
    proc = start_serve(endpoint, ["--checkpoint-store", staged["store"], "--shared-host", "--budget", "0.4",
                                  "--lookahead", "1", *[f"--{k}={v}" for k, v in SMALL.items()]],
                       _env(), workers=WORKERS, timeout=240)
    try:
        with Client(endpoint, timeout=2) as c:
            _infer_all(endpoint, staged["want"], 3)
            doc = c.status()
            shared = doc["front"]["shared_host"]
            daemons = [w["daemon"]["shared_host"] for w in doc["workers"]]
            # One read of the store per tensor, by the front's tier; none by a worker.
            assert shared["counters"]["fills"] == staged["params"]
            assert shared["counters"]["fill_bytes"] == staged["bytes"]
            assert sum(d["hits"] for d in daemons) > 0
            assert [d["fallbacks"] for d in daemons] == [0] * WORKERS
            assert len(shared["workers"]) == WORKERS
            # docs/shared-host.md, "Watching it": the text status shows the tier too.
            text = subprocess.run([sys.executable, "-m", "prefetchd.cli", "status", "--endpoint", endpoint],
                                  env=_env(), capture_output=True, text=True, timeout=60)
            assert text.returncode == 0, text.stderr
            assert f"shared host {shared['socket']}: " in text.stdout and "covering " in text.stdout
            assert text.stdout.count("  shared   ") == WORKERS, text.stdout
            # A worker killed while requests run: no lease of it stays, nothing is lost.
            victim = doc["workers"][0]["pid"]
            os.kill(victim, signal.SIGKILL)
            # (A request in flight on the victim is answered INTERNAL by the front, as for any
            # worker death; the ones after its death is seen go to the survivors.)
            assert wait_until(lambda: c.status()["front"]["counters"].get("worker_deaths") == 1, 30)
            _infer_all(endpoint, staged["want"], 2)
            assert wait_until(lambda: c.ping()["workers"] == WORKERS, 240, 0.5)
            _infer_all(endpoint, staged["want"], 1)
            doc = c.status()
            shared = doc["front"]["shared_host"]
            assert victim not in [w["pid"] for w in shared["workers"]]
            assert len(shared["workers"]) == WORKERS
            # Idle, each worker holds a lease exactly on the blocks its device tier maps
            # (resident weights, no copy); the victim's died with its socket.
            assert wait_until(lambda: _leases_match(c.status()), 10)
            assert shared["counters"]["fills"] == staged["params"]     # no block lost or refilled
            assert shared["counters"]["fill_errors"] == 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
