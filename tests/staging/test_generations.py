"""A stage is one generation of the store directory: visible whole, or not at all."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from prefetchd import _native
from prefetchd.staging import INDEX_FILE, StagingError, read_index, read_meta, stage_checkpoint
from ckpt_files import write_safetensors
from helpers import ENV
from _store_helpers import daemon_open_meets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def store_contents(store_dir):
    """{name: (shape, dtype name, first element)} of everything the store directory holds."""
    store = _native.FileStore(store_dir)
    try:
        out = {}
        for key in store.keys():
            shape, dtype = read_meta(store.info(key))
            dst = _native.aligned_buffer(max(store.info(key)["nbytes"], 1))
            store.read_sync(key, dst, True)
            out[key] = (shape, dtype.name, np.frombuffer(dst, dtype, 1)[0].item())
        return out
    finally:
        store.close()


def assert_index_matches_store(store_dir):
    index = read_index(store_dir)["tensors"]
    held = store_contents(store_dir)
    assert set(index) == set(held)
    for name, entry in index.items():
        assert (tuple(entry["shape"]), entry["dtype"]) == held[name][:2]
    return held


def test_restaging_adds_replaces_and_keeps_other_tensors(tmp_path):
    store = str(tmp_path / "store")
    write_safetensors(str(tmp_path / "a.safetensors"), {"x": np.full(4, 1, np.float32), "y": np.full(3, 1, np.int8)})
    write_safetensors(str(tmp_path / "b.safetensors"), {"x": np.full((2, 3), 2, np.float32),
                                                        "z": np.full(5, 2, np.int64)})
    assert stage_checkpoint(str(tmp_path / "a.safetensors"), store)["generation"] == 1
    report = stage_checkpoint(str(tmp_path / "b.safetensors"), store)
    assert report["generation"] == 2 and report["tensors"] == 2 and report["store_tensors"] == 3
    held = assert_index_matches_store(store)
    assert held == {"x": ((2, 3), "float32", 2.0), "y": ((3,), "int8", 1), "z": ((5,), "int64", 2)}
    doc = read_index(store)
    assert doc["generation"] == 2 and doc["checkpoint"].endswith("b.safetensors")
    assert sorted(os.listdir(tmp_path)) == [".store.stage-lock", "a.safetensors", "b.safetensors", "store"]


def test_a_failed_stage_leaves_the_previous_generation_whole(tmp_path):
    store = str(tmp_path / "store")
    write_safetensors(str(tmp_path / "a.safetensors"), {"x": np.full(4, 1, np.float32)})
    stage_checkpoint(str(tmp_path / "a.safetensors"), store)
    before = open(os.path.join(store, INDEX_FILE), "rb").read()
    # valid header, the second tensor's bytes fail MindSpore's crc_num: found only after x was written
    write_safetensors(str(tmp_path / "b.safetensors"), {"x": np.full(4, 2, np.float32), "w": np.ones(2, np.int8)},
                      metadata={"crc_num": "12345"})
    with pytest.raises(StagingError, match="b.safetensors: __metadata__.crc_num is 12345"):
        stage_checkpoint(str(tmp_path / "b.safetensors"), store)
    assert open(os.path.join(store, INDEX_FILE), "rb").read() == before
    assert assert_index_matches_store(store) == {"x": ((4,), "float32", 1.0)}
    assert not glob.glob(str(tmp_path / ".store.staging-*"))


def test_a_second_stager_of_the_same_store_is_refused(tmp_path):
    import fcntl
    store = str(tmp_path / "store")
    write_safetensors(str(tmp_path / "a.safetensors"), {"x": np.ones(4, np.float32)})
    with open(tmp_path / ".store.stage-lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with pytest.raises(StagingError, match=f"^{store}: another `prefetchd stage` is writing this store"):
            stage_checkpoint(str(tmp_path / "a.safetensors"), store)
    assert stage_checkpoint(str(tmp_path / "a.safetensors"), store)["tensors"] == 1


def test_a_daemon_refused_during_a_stage_names_the_stage_not_the_locks_last_holder(tmp_path):
    """The stage took the store's lock without writing its pid: a daemon refused meanwhile
    named whichever process had last written it (long gone)."""
    from prefetchd.staging.generations import hold_store_lock
    store = str(tmp_path / "store")
    write_safetensors(str(tmp_path / "a.safetensors"), {"x": np.ones(4, np.float32)})
    stage_checkpoint(str(tmp_path / "a.safetensors"), store)
    earlier = subprocess.run([sys.executable, "-c", "import sys; from prefetchd import _native; "
                              "_native.FileStore(sys.argv[1]).close()", store], env=ENV, timeout=120)
    assert earlier.returncode == 0                       # its pid stays in the lock file
    lock = hold_store_lock(store)                        # what a stage holds while it swaps
    try:
        with pytest.raises(_native.StoreInUse, match=f"in use by pid {os.getpid()} "):
            _native.FileStore(store)
    finally:
        lock.release(swapped=False)


@pytest.mark.parametrize("store_exists", [False, True])
def test_a_daemon_opening_the_store_during_a_stage_is_refused(tmp_path, monkeypatch, store_exists):
    """A store path that did not exist when the stage began was not locked: a daemon opened
    it meanwhile, made the directory, wrote its tensor there, and the swap retired that
    directory with the tensor, deleted. The stage now holds the lock of the path from the
    start, made or not."""
    from prefetchd.staging import generations
    store = str(tmp_path / "store")
    write_safetensors(str(tmp_path / "a.safetensors"), {"x": np.ones(4, np.float32)})
    if store_exists:
        stage_checkpoint(str(tmp_path / "a.safetensors"), store)
    seen = []

    def stage_into(*args, **kwargs):                     # a daemon opens the store mid-stage
        seen.append(daemon_open_meets(store))
        return real(*args, **kwargs)
    real = generations.stage_into
    monkeypatch.setattr(generations, "stage_into", stage_into)
    stage_checkpoint(str(tmp_path / "a.safetensors"), store)
    assert len(seen) == 1 and f"in use by pid {os.getpid()}" in seen[0], seen
    assert assert_index_matches_store(store) == {"x": ((4,), "float32", 1.0)}
    if not store_exists:
        assert os.stat(store).st_mode & 0o777 == 0o700        # as a FileStore makes one


def test_a_failed_first_stage_leaves_no_store_directory(tmp_path, monkeypatch):
    """...and removes it while it still holds its lock: let go first, a daemon could open the
    directory in between, write there, and lose what it wrote to the removal."""
    from prefetchd.staging import generations
    store = tmp_path / "store"
    write_safetensors(str(tmp_path / "b.safetensors"), {"x": np.full(4, 2, np.float32)},
                      metadata={"crc_num": "12345"})
    seen, real = [], generations.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        if str(path) == str(store):               # a daemon opens the store just then
            seen.append(daemon_open_meets(store))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(generations.shutil, "rmtree", rmtree)
    with pytest.raises(StagingError, match="crc_num"):
        stage_checkpoint(str(tmp_path / "b.safetensors"), str(store))
    assert len(seen) == 1 and f"in use by pid {os.getpid()}" in seen[0] and not store.exists(), seen


def test_a_store_open_in_a_daemon_is_refused_and_its_quarantine_is_kept(tmp_path):
    store = str(tmp_path / "store")
    write_safetensors(str(tmp_path / "a.safetensors"), {"x": np.ones(4, np.float32)})
    stage_checkpoint(str(tmp_path / "a.safetensors"), store)
    os.mkdir(os.path.join(store, "quarantine"))
    with open(os.path.join(store, "quarantine", "torn.pfd"), "wb") as f:
        f.write(b"evidence")
    index_before = open(os.path.join(store, INDEX_FILE), "rb").read()
    held = _native.FileStore(store)                       # what a running daemon holds
    try:
        with pytest.raises(StagingError, match=rf"{store}: in use by pid {os.getpid()} \(a daemon has"):
            stage_checkpoint(str(tmp_path / "a.safetensors"), store)
    finally:
        held.close()
    assert open(os.path.join(store, INDEX_FILE), "rb").read() == index_before
    assert stage_checkpoint(str(tmp_path / "a.safetensors"), store)["generation"] == 2
    assert open(os.path.join(store, "quarantine", "torn.pfd"), "rb").read() == b"evidence"
    assert_index_matches_store(store)
    os.mkdir(os.path.join(store, "mine"))
    with pytest.raises(StagingError, match=r"store: holds a subdirectory 'mine'"):
        stage_checkpoint(str(tmp_path / "a.safetensors"), store)


STAGE_SLOWLY = """
import sys
from prefetchd.staging import stage_checkpoint
stage_checkpoint(sys.argv[1], sys.argv[2], progress=True, progress_interval=0)
print("committed", flush=True)
"""


def test_stage_killed_midway_leaves_the_previous_index_and_tensors(tmp_path):
    """SIGKILL a `stage` of a 256 MiB checkpoint partway (each store write slowed to 100 ms so it
    is surely partway): the index and every tensor it names are the previous generation's."""
    store = str(tmp_path / "store")
    old = {f"w{i:02d}": np.full(1 << 20, 1, np.float32) for i in range(8)}
    write_safetensors(str(tmp_path / "old.safetensors"), old)
    stage_checkpoint(str(tmp_path / "old.safetensors"), store)
    index_before = open(os.path.join(store, INDEX_FILE), "rb").read()

    new = {f"w{i:02d}": np.full(2 << 20, 2, np.float32) for i in range(32)}   # 32 x 8 MiB, new shapes
    write_safetensors(str(tmp_path / "new.safetensors"), new)
    del new
    env = dict(os.environ, PREFETCHD_FAULTS="write:delay:nth=1:count=100000:delay_ms=100")
    log = open(tmp_path / "stage.log", "w+")
    proc = subprocess.Popen([sys.executable, "-c", STAGE_SLOWLY, str(tmp_path / "new.safetensors"), store],
                            stdout=subprocess.PIPE, stderr=log, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 60
        while "prefetchd stage: 6/32 tensors" not in open(tmp_path / "stage.log").read():
            assert proc.poll() is None, open(tmp_path / "stage.log").read()
            assert time.monotonic() < deadline, "staging never got going"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert b"committed" not in proc.stdout.read()
    assert open(os.path.join(store, INDEX_FILE), "rb").read() == index_before
    held = assert_index_matches_store(store)
    assert held == {name: ((1 << 20,), "float32", 1.0) for name in old}
    assert glob.glob(str(tmp_path / ".store.staging-*")), "the killed stage's work directory is gone?"

    # the next stage finishes the job and clears what the killed one left
    report = stage_checkpoint(str(tmp_path / "new.safetensors"), store)
    assert report["tensors"] == 32 and report["generation"] == 2
    assert set(assert_index_matches_store(store).values()) == {((2 << 20,), "float32", 2.0)}
    assert not glob.glob(str(tmp_path / ".store.staging-*"))
