"""`prefetchd serve --checkpoint-store DIR`: a model factory's parameters served
from a store made by `prefetchd stage`, in real processes (stage, serve, infer,
status, SIGTERM), plus what is refused before any worker starts."""
import argparse
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import start_serve, stop_serve, wait_until
from prefetchd.cli.common import UsageError
from prefetchd.cli.control import format_status
from prefetchd.errors import ConfigError
from prefetchd.control import Client, RequestTimeout
from prefetchd.serve.spec import ServeSpec, check_checkpoint_store, demo_model
from prefetchd.serve import Client as ServeClient
from prefetchd.serve.worker import link_checkpoint_store

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(hidden=64, layers=2, batch=2, seq=8)
SERVE_SMALL = ["--hidden", "64", "--layers", "2", "--batch", "2", "--seq", "8"]
STAGED_SEED = 7          # the factory alone would build seed 0: a match proves the store's weights
X = np.random.default_rng(3).standard_normal((SMALL["batch"], SMALL["seq"], SMALL["hidden"])) \
    .astype(np.float32)


def _env():
    return dict(os.environ, PYTHONPATH=os.pathsep.join([REPO] + sys.path))


def _output(cell):
    import mindspore as ms
    return cell(ms.Tensor(X)).asnumpy()


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """A demo-model checkpoint staged with the real `prefetchd stage`; the outputs a
    request must and must not produce."""
    import mindspore as ms
    d = tmp_path_factory.mktemp("ckpt")
    spec = ServeSpec(models=1, **SMALL)
    cell, _ = demo_model(seed=STAGED_SEED, spec=spec)
    ckpt = str(d / "model.ckpt")
    ms.save_checkpoint(cell, ckpt)
    want = _output(cell)
    unstaged = _output(demo_model(seed=0, spec=spec)[0])
    store = str(d / "store")
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "stage", ckpt, "--store", store,
                          "--quiet"], env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    params = list(cell.get_parameters())
    return {"store": store, "ckpt": ckpt, "want": want, "unstaged": unstaged, "params": len(params),
            "bytes": sum(int(np.prod(p.shape)) * 4 for p in params)}


def _tensor_files(store):
    return sorted(os.path.join(store, f) for f in os.listdir(store) if f.endswith(".pfd"))


def test_serve_answers_with_the_staged_weights(staged):
    store = staged["store"]
    files = _tensor_files(store)
    assert len(files) == staged["params"] and all(os.stat(f).st_nlink == 1 for f in files)
    before = {f: os.stat(f).st_ino for f in files}
    parent = os.path.dirname(store)
    endpoint = f"ipc://ckpt-serve-{os.getpid()}.sock"
    cmd = [sys.executable, "-m", "prefetchd.cli", "serve", "--endpoint", endpoint, "--workers", "1",
           "--checkpoint-store", store, "--hidden", "64", "--layers", "2", "--batch", "2",
           "--seq", "8"]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        with Client(endpoint, timeout=1) as c:
            def up():
                try:
                    return c.ping()["workers"] == 1
                except RequestTimeout:
                    return proc.poll() is not None
            assert wait_until(up, 120, 0.2) and proc.poll() is None, proc.stderr.read().decode()
            assert c.ping()["models"] == ["m0"]                 # one weight set: the store's
            with ServeClient(endpoint, timeout=60) as sc:
                (y,) = sc.infer("m0", X)
            assert np.array_equal(y, staged["want"])
            assert not np.allclose(y, staged["unstaged"], rtol=1e-3)
            worker = c.status()["workers"][0]["daemon"]
            assert worker["tensors"] == staged["params"]
        # The worker's store is hard links to the staged files (no copy), beside the store.
        assert all(os.stat(f).st_nlink == 2 for f in files)
        scratch = [e for e in os.listdir(parent) if e.startswith(".prefetchd-serve-")]
        assert len(scratch) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    # The temporary worker stores are gone; the staged store is exactly as it was.
    assert not [e for e in os.listdir(parent) if e.startswith(".prefetchd-serve-")]
    assert {f: os.stat(f).st_ino for f in _tensor_files(store)} == before
    assert all(os.stat(f).st_nlink == 1 for f in files)


def test_more_than_one_weight_set_from_a_store_is_refused(staged):
    with pytest.raises(ConfigError, match="one weight set"):
        ServeSpec(models=2, checkpoint_store=staged["store"])
    from prefetchd.cli.serve import register, serve_options, serve_spec
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--checkpoint-store", staged["store"]])
    assert serve_spec(serve_options(args)).model_names() == ["m0"]
    args = parser.parse_args(["serve", "--checkpoint-store", staged["store"], "--models", "3"])
    with pytest.raises(UsageError, match="--models 3"):        # both flags: exit 2
        serve_spec(serve_options(args))


def test_fractional_budget_of_a_custom_model_uses_the_store_size(staged):
    from prefetchd.cli.serve import register, serve_options, serve_spec
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    custom = ["serve", "--model", "prefetchd.demo.model:build_model", "--budget", "50%"]
    with pytest.raises(UsageError, match="needs --model-bytes"):       # nothing to size it by
        serve_spec(serve_options(parser.parse_args(custom)))
    spec = serve_spec(serve_options(parser.parse_args(
        custom + ["--checkpoint-store", staged["store"]])))
    assert spec.model_bytes() == staged["bytes"]          # the index's tensor bytes
    assert spec.device_budget() == staged["bytes"] // 2


def test_stores_that_cannot_serve_are_refused(tmp_path, staged):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="not a store made by `prefetchd stage`"):
        check_checkpoint_store(ServeSpec(models=1, checkpoint_store=str(empty)))
    with pytest.raises(ConfigError, match="not a directory"):
        check_checkpoint_store(ServeSpec(models=1, checkpoint_store=str(tmp_path / "missing")))
    spec = ServeSpec(models=1, checkpoint_store=staged["store"])
    with pytest.raises(ConfigError, match="one is inside the other"):
        check_checkpoint_store(spec, os.path.join(staged["store"], "workers"))
    with pytest.raises(ConfigError, match="one is inside the other"):
        check_checkpoint_store(spec, os.path.dirname(staged["store"]))
    check_checkpoint_store(spec, str(tmp_path))          # a sibling on the same filesystem


def test_store_on_another_filesystem_is_refused(staged):
    other = "/dev/shm"
    if not os.path.isdir(other) or os.stat(other).st_dev == os.stat(staged["store"]).st_dev:
        pytest.skip("no directory on another filesystem than the test's tmp_path")
    spec = ServeSpec(models=1, checkpoint_store=staged["store"])
    with pytest.raises(ConfigError, match="another filesystem"):
        check_checkpoint_store(spec, other)
    dst = os.path.join(other, f"pfd-link-{os.getpid()}")
    try:
        with pytest.raises(ConfigError, match="another filesystem"):
            link_checkpoint_store(staged["store"], dst)
    finally:
        import shutil
        shutil.rmtree(dst, ignore_errors=True)


def test_link_takes_only_tensor_files(tmp_path, staged):
    dst = str(tmp_path / "w0")
    link_checkpoint_store(staged["store"], dst)
    assert sorted(os.listdir(dst)) == [os.path.basename(f) for f in _tensor_files(staged["store"])]
    assert all(os.path.samefile(os.path.join(dst, os.path.basename(f)), f)
               for f in _tensor_files(staged["store"]))


def _stage(ckpt, store):
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "stage", ckpt, "--store", store, "--quiet"],
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def _serving_a_store_with_another_checkpoint(tmp_path, staged, workers):
    """A real `prefetchd serve` of a store staged from the staged checkpoint, and another
    checkpoint to stage into that store while it serves: (proc, endpoint, store, other)."""
    import mindspore as ms
    store, other = str(tmp_path / "store"), str(tmp_path / "other.ckpt")
    _stage(staged["ckpt"], store)
    ms.save_checkpoint(demo_model(seed=STAGED_SEED + 1, spec=ServeSpec(models=1, **SMALL))[0], other)
    endpoint = f"ipc://{tmp_path}/serve.sock"
    proc = start_serve(endpoint, ["--checkpoint-store", store, *SERVE_SMALL], _env(), workers=workers)
    return proc, endpoint, store, other


def test_a_worker_respawned_after_a_new_stage_is_refused_not_served_other_weights(tmp_path, staged):
    """`prefetchd stage` of another checkpoint into the served store, then a worker death: the
    respawned worker linked the new files and served other weights than the other worker
    under the same model name, with no warning. It is refused now; the others serve on."""
    proc, endpoint, store, other = _serving_a_store_with_another_checkpoint(tmp_path, staged, workers=2)
    try:
        with Client(endpoint, timeout=2) as c, ServeClient(endpoint, timeout=60) as sc:
            def workers():
                try:
                    return c.ping()["workers"]
                except RequestTimeout:
                    return -1 if proc.poll() is not None else 0
            _stage(other, store)                                   # the store moves on meanwhile
            os.kill(c.status()["workers"][0]["pid"], signal.SIGKILL)
            assert wait_until(lambda: workers() == 1, 30, 0.2)
            for _ in range(12):                                    # through respawn attempts
                (y,) = sc.infer("m0", X)
                assert np.array_equal(y, staged["want"])
            assert wait_until(lambda: "replaced it since the server started" in _log_so_far(proc), 60, 0.5)
            # Given up after its start failures: status said 'starting' (a restart not coming).
            assert wait_until(lambda: c.status()["workers"][0]["given_up"], 60, 0.2)
            doc = c.status()
            assert "replaced it since the server started" in doc["workers"][0]["start_error"]
            assert not doc["workers"][1]["given_up"] and doc["workers"][1]["ready"]
            text = format_status(doc)
            assert "worker 0: pid None, given up, trying again in " in text and "  could not start: " in text, text
    finally:
        stop_serve(proc)


def test_a_server_whose_last_worker_gave_up_exits_saying_why(tmp_path, staged):
    """With one worker, a restage and its death left the front up with no worker: status said
    'starting', every request waited out its timeout, and nothing was logged as an error. The
    server now stops (exit 1, one line saying why), so its supervisor restarts it."""
    proc, endpoint, store, other = _serving_a_store_with_another_checkpoint(tmp_path, staged, workers=1)
    try:
        with Client(endpoint, timeout=5) as c:
            pid = c.status()["workers"][0]["pid"]
        _stage(other, store)
        os.kill(pid, signal.SIGKILL)
        code = proc.wait(120)
        err = _log_so_far(proc)
        assert code == 1, err[-3000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("prefetchd: error: ") and "prefetchd serve: no worker could be started again" in last \
            and "replaced it since the server started" in last, err[-3000:]
    finally:
        if proc.poll() is None:
            stop_serve(proc)


def _log_so_far(proc):
    """stderr read so far, without blocking (the server is still running)."""
    os.set_blocking(proc.stderr.fileno(), False)
    chunk = proc.stderr.read() or ""
    proc.seen = getattr(proc, "seen", "") + chunk
    return proc.seen


def test_link_refuses_a_store_staged_again_since_the_server_started(tmp_path, staged):
    from prefetchd.staging import read_index
    started_with = read_index(staged["store"]).get("generation")
    assert started_with is not None
    link_checkpoint_store(staged["store"], str(tmp_path / "w0"), started_with)
    with pytest.raises(ConfigError, match="replaced it since the server started"):
        link_checkpoint_store(staged["store"], str(tmp_path / "w1"), started_with + 1)


def test_a_weight_that_fails_its_checksum_is_a_storage_error_never_an_answer(tmp_path, staged):
    from prefetchd.control.codes import ServiceError
    from prefetchd.errors import StorageError
    store = str(tmp_path / "store")
    _stage(staged["ckpt"], store)
    endpoint = f"ipc://{tmp_path}/serve.sock"
    proc = start_serve(endpoint, ["--checkpoint-store", store, *SERVE_SMALL, "--budget", "40%"], _env())
    try:
        with ServeClient(endpoint, timeout=60) as sc:
            victim = max(_tensor_files(store), key=os.path.getsize)     # a weight, not a bias
            with open(victim, "r+b") as f:
                f.seek(os.path.getsize(victim) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
            with pytest.raises((StorageError, ServiceError)) as err:
                sc.infer("m0", X)
            assert isinstance(err.value, StorageError), err.value        # STORAGE, not INTERNAL
            assert "verif" in str(err.value) or "checksum" in str(err.value), err.value
    finally:
        stop_serve(proc)
