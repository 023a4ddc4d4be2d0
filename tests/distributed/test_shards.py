"""`prefetchd stage --shard`: per-rank stores from per-rank checkpoints or one split checkpoint,
all ranks or none, read back from the real stores on disk."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import ENV, REPO
from _store_helpers import daemon_open_meets
from prefetchd import Config
from prefetchd.staging import (INDEX_FILE, SHARDS_FILE, StagingError, read_index, stage_checkpoint,
                               stage_sharded)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "staging"))
from ckpt_files import write_safetensors  # noqa: E402

RNG = np.random.default_rng(7)
WHOLE = {"layers.0.wq.weight": RNG.normal(size=(8, 6)).astype(np.float32),       # column-parallel
         "layers.0.wq.bias": RNG.normal(size=(8,)).astype(np.float32),
         "layers.0.wo.weight": RNG.normal(size=(6, 8)).astype(np.float32),       # row-parallel
         "layers.0.norm.gamma": RNG.normal(size=(6,)).astype(np.float32),        # replicated
         "embed.table": RNG.integers(0, 9, (5, 6)).astype(np.int64)}
SPEC = "*.wq.*=0,*.wo.weight=1"


def read_store(directory):
    """{name: array} of everything a store directory holds, read (checksum-verified) from disk."""
    from prefetchd import _native
    from prefetchd.backend.base import open_store
    from prefetchd.staging import read_meta
    store = open_store(Config.load(env={}, store_dir=directory))
    try:
        out = {}
        for key in store.keys():
            info = store.info(key)
            shape, dtype = read_meta(info)
            buf = _native.aligned_buffer(max(info["nbytes"], 1))
            store.read_sync(key, buf, True)
            out[key] = np.frombuffer(memoryview(buf), np.uint8)[:info["nbytes"]].view(dtype).reshape(shape).copy()
        return out
    finally:
        store.close()


def test_a_split_checkpoint_gives_each_rank_its_slices(tmp_path):
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    report = stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)
    assert report["world_size"] == 2 and report["generation"] == 1
    shards = json.load(open(tmp_path / "store" / SHARDS_FILE))
    assert shards["world_size"] == 2 and shards["spec"] == {"*.wq.*": 0, "*.wo.weight": 1}
    for r in (0, 1):
        held = read_store(str(tmp_path / "store" / f"rank_{r}"))
        assert set(held) == set(WHOLE)
        np.testing.assert_array_equal(held["layers.0.wq.weight"], WHOLE["layers.0.wq.weight"][4 * r:4 * r + 4])
        np.testing.assert_array_equal(held["layers.0.wq.bias"], WHOLE["layers.0.wq.bias"][4 * r:4 * r + 4])
        np.testing.assert_array_equal(held["layers.0.wo.weight"], WHOLE["layers.0.wo.weight"][:, 4 * r:4 * r + 4])
        np.testing.assert_array_equal(held["layers.0.norm.gamma"], WHOLE["layers.0.norm.gamma"])
        np.testing.assert_array_equal(held["embed.table"], WHOLE["embed.table"])
        index = read_index(str(tmp_path / "store" / f"rank_{r}"))["tensors"]
        assert index["layers.0.wo.weight"]["shape"] == [6, 4]
        assert report["ranks"][str(r)]["bytes"] == sum(a.nbytes for a in held.values())


def test_a_daemon_opening_a_rank_store_during_a_sharded_stage_is_refused(tmp_path, monkeypatch):
    """A new root's rank directories were made only by the swap: a daemon that opened
    ROOT/rank_1 meanwhile made it and wrote there, and the swap deleted what it wrote. Every
    rank's lock is now held, its directory made, before any rank is staged."""
    from prefetchd.staging import shards
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    seen = []

    def stage_into(*args, **kwargs):
        seen.append(daemon_open_meets(tmp_path / "store" / "rank_1"))
        return real(*args, **kwargs)
    real = shards.stage_into
    monkeypatch.setattr(shards, "stage_into", stage_into)
    stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)
    assert len(seen) == 2 and all(f"in use by pid {os.getpid()}" in e for e in seen), seen
    assert set(read_store(str(tmp_path / "store" / "rank_1"))) == set(WHOLE)


def test_a_plain_stage_refused_at_a_sharded_root_leaves_nothing_there(tmp_path):
    """It left the store lock file it had made in the root, and every later `stage --shard`
    refused the root for holding '.pfd-lock', which is no rank store."""
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)
    before = sorted(os.listdir(tmp_path / "store"))
    with pytest.raises(StagingError, match="holds a subdirectory 'rank_0'"):
        stage_checkpoint(str(src), str(tmp_path / "store"))
    assert sorted(os.listdir(tmp_path / "store")) == before
    assert stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)["generation"] == 2


def test_per_rank_checkpoints_in_mindsporess_layout_stage_one_store_each(tmp_path):
    for r in (0, 1, 2):
        (tmp_path / "ckpt" / f"rank_{r}").mkdir(parents=True)
        write_safetensors(tmp_path / "ckpt" / f"rank_{r}" / "net.safetensors",
                          {"w": np.full((3,), r, np.float32), "shared": np.arange(4, dtype=np.float32)})
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "stage", str(tmp_path / "ckpt"), "--store",
                          str(tmp_path / "store"), "--shard", "per-rank", "--json", "--quiet"],
                         capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["world_size"] == 3
    for r in (0, 1, 2):
        np.testing.assert_array_equal(read_store(str(tmp_path / "store" / f"rank_{r}"))["w"], [r, r, r])


def _snapshot(root):
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, files in os.walk(root) for f in files if not f.startswith(".pfd-lock")}


def test_a_failing_rank_stages_no_rank(tmp_path, ms):
    """rank_1's .ckpt fails its crc_num check, found only once its tensors were read (after
    rank_0's new store was built): rank_0 keeps its previous generation too."""
    def save(r, value):
        (tmp_path / "ckpt" / f"rank_{r}").mkdir(parents=True, exist_ok=True)
        ms.save_checkpoint([{"name": "w", "data": ms.Tensor(np.full((64,), value, np.float32))}],
                           str(tmp_path / "ckpt" / f"rank_{r}" / "net.ckpt"), crc_check=True)
    save(0, 0)
    save(1, 1)
    stage_sharded(str(tmp_path / "ckpt"), str(tmp_path / "store"))
    before = _snapshot(tmp_path / "store")
    save(0, 10)
    save(1, 11)
    bad = tmp_path / "ckpt" / "rank_1" / "net.ckpt"
    raw = bytearray(bad.read_bytes())
    raw[-40] ^= 0xFF                                   # a byte of w's data: the structure still reads
    bad.write_bytes(bytes(raw))
    with pytest.raises(StagingError, match="rank_1.*(crc|checksum)"):
        stage_sharded(str(tmp_path / "ckpt"), str(tmp_path / "store"))
    assert _snapshot(tmp_path / "store") == before
    np.testing.assert_array_equal(read_store(str(tmp_path / "store" / "rank_0"))["w"], np.zeros(64))
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".store.staging")]


def test_a_split_that_cannot_be_cut_stages_nothing(tmp_path):
    """An axis that does not divide, a glob that matches nothing: refused, the store as it was."""
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)
    before = _snapshot(tmp_path / "store")
    with pytest.raises(StagingError, match="does not divide into 3 ranks"):
        stage_sharded(str(src), str(tmp_path / "other"), spec="*.norm.gamma=0,*.wq.weight=0", world_size=3)
    assert not (tmp_path / "other").exists()
    write_safetensors(src, {**WHOLE, "layers.0.wq.weight": WHOLE["layers.0.wq.weight"] + 1})
    with pytest.raises(StagingError, match="matches no tensor"):
        stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC + ",*.typo=0", world_size=2)
    assert _snapshot(tmp_path / "store") == before


def test_a_glob_that_matches_nothing_is_refused_before_any_rank_is_staged(tmp_path, monkeypatch):
    # Found at the end of rank 0's stage, it came after rank 0 was staged whole (an outside probe).
    from prefetchd.staging import shards
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    monkeypatch.setattr(shards, "stage_into", lambda *a, **k: pytest.fail("a rank was staged"))
    with pytest.raises(StagingError, match=r"sharding spec '\*.typo' matches no tensor of"):
        stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC + ",*.typo=0", world_size=2)
    assert not (tmp_path / "store").exists()


def test_a_tensor_the_spec_cannot_cut_is_refused_before_any_rank_or_directory(tmp_path, monkeypatch):
    # Found in rank 0's stage, it left an empty rank_0 behind, and a later stage of the right
    # number of ranks into that root was refused (an outside probe).
    from prefetchd.staging import shards
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    monkeypatch.setattr(shards, "stage_into", lambda *a, **k: pytest.fail("a rank was staged"))
    for spec, says in (("*.wq.weight=0", "does not divide into 3 ranks"),
                       ("*.wq.weight=5", r"of shape \[8, 6\] has no axis 5"),
                       ("*.wq.*=0,*.wq.weight=1", "matches '\\*.wq.\\*' \\(axis 0\\) and '\\*.wq.weight' \\(axis 1\\)")):
        with pytest.raises(StagingError, match=says):
            stage_sharded(str(src), str(tmp_path / "store"), spec=spec, world_size=3)
        assert os.listdir(tmp_path) == ["whole.safetensors"]


def test_more_ranks_than_the_open_file_limit_holds_are_refused_before_any_lock(tmp_path):
    # One lock per rank is held through the stage: at the limit, the rank that failed to
    # open its lock and rank_0 were left behind. Refused at once where the hard limit is
    # too low; the soft limit is raised where the hard one allows.
    import resource
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, {"w": np.ones((200, 2), np.float32)})
    script = (f"import resource, sys\nresource.setrlimit(resource.RLIMIT_NOFILE, (64, {{hard}}))\n"
              f"from prefetchd.staging import stage_sharded\n"
              f"r = stage_sharded({str(src)!r}, sys.argv[1], spec='w=0', world_size=100)\n"
              f"print(r['world_size'], resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    low = subprocess.run([sys.executable, "-c", script.format(hard=64), str(tmp_path / "low")],
                         capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert low.returncode == 1 and "staging 100 ranks holds one lock per rank, and the open-file limit is " \
                                   "64: raise it (ulimit -n 164)" in low.stderr, low.stderr
    assert not (tmp_path / "low").exists()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 164:
        pytest.skip(f"this machine's hard open-file limit is {hard}")
    ok = subprocess.run([sys.executable, "-c", script.format(hard=hard), str(tmp_path / "ok")],
                        capture_output=True, text=True, env=ENV, cwd=REPO, timeout=300)
    assert ok.returncode == 0 and ok.stdout.split() == ["100", "164"], ok.stderr
    assert len(os.listdir(tmp_path / "ok")) == 100 + 1        # rank_0..rank_99 and the shards file


@pytest.mark.parametrize("argv, words", [
    (["--shard", "*.w=0"], "needs --ranks N"),
    (["--shard", "per-rank", "--ranks", "2"], "--ranks is for splitting"),
    (["--ranks", "2"], "--ranks needs --shard"),
    (["--shard", "per-rank", "--any-rank"], "--any-rank is for one checkpoint"),
    (["--shard", "*.w=x", "--ranks", "2"], "axis 'x' is not an integer"),
    (["--shard", "*.w", "--ranks", "2"], "expected GLOB=AXIS"),
    (["--shard", "nospec.json", "--ranks", "2"], "sharding spec nospec.json: no such file"),
    (["--shard", "*.wq.weight=5", "--ranks", "2"], "has no axis 5"),
])
def test_stage_shard_command_line_errors_are_one_line(tmp_path, argv, words):
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "stage", str(src), "--store",
                          str(tmp_path / "store"), "--quiet", *argv],
                         capture_output=True, text=True, cwd=REPO, env=ENV, timeout=120)
    assert out.returncode in (1, 2) and words in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "store").exists()


def test_refuses_a_store_of_another_world_or_a_plain_store(tmp_path):
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)
    with pytest.raises(StagingError, match="a sharded store of 2 ranks; staging 4"):
        stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=4)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / INDEX_FILE).write_text("{}")
    with pytest.raises(StagingError, match="not a sharded store"):
        stage_sharded(str(src), str(plain), spec=SPEC, world_size=2)
    second = stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)
    assert second["generation"] == 2


def test_refuses_while_a_ranks_daemon_has_its_store_open(tmp_path, ms):
    from prefetchd import Daemon
    from prefetchd.ranks import RankInfo, rank_config
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)
    before = _snapshot(tmp_path / "store")
    config = rank_config(Config.load(env={}, store_dir=str(tmp_path / "store"), device_budget="4MiB"),
                         RankInfo(1, 2, 1, "argument"))
    with Daemon(config):
        with pytest.raises(StagingError, match=r"rank_1: in use by pid \d+"):
            stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)
    assert _snapshot(tmp_path / "store") == before
    assert stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)["generation"] == 2


def test_two_directories_naming_one_rank_are_refused(tmp_path):
    """rank_2/ and a stale rank_0002/ both parse as rank 2: staging either would be a guess."""
    for name, value in [("rank_0", 0), ("rank_1", 1), ("rank_2", 2), ("rank_0002", 99)]:
        (tmp_path / "ckpt" / name).mkdir(parents=True)
        write_safetensors(tmp_path / "ckpt" / name / "net.safetensors", {"w": np.full((2,), value, np.float32)})
    with pytest.raises(StagingError, match="rank_0002/ and rank_2/ both name rank 2"):
        stage_sharded(str(tmp_path / "ckpt"), str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


@pytest.mark.parametrize("doc, words", [
    ({"*.wq.weight": 1.7}, "axis 1.7 is not an integer"),
    ({"*.wq.weight": True}, "axis True is not an integer"),
    ({"*.wq.weight": [0]}, r"axis \[0\] is not an integer"),
    ({"*.wq.weight": "0"}, "axis '0' is not an integer"),        # docs/distributed.md: JSON's own integers
])
def test_a_json_spec_axis_must_be_an_integer(tmp_path, doc, words):
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    (tmp_path / "spec.json").write_text(json.dumps(doc))
    with pytest.raises(StagingError, match=words):
        stage_sharded(str(src), str(tmp_path / "store"), spec=str(tmp_path / "spec.json"), world_size=2)


def test_overlapping_globs_must_agree(tmp_path):
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    with pytest.raises(StagingError, match="given twice"):
        stage_sharded(str(src), str(tmp_path / "store"), spec="*.wq.weight=0,*.wq.weight=1", world_size=2)
    # The same in a JSON file (json's dict kept the last one, unseen: an outside probe).
    (tmp_path / "spec.json").write_text('{"*.wq.weight": 0, "*.wq.weight": 1}')
    with pytest.raises(StagingError, match="given twice"):
        stage_sharded(str(src), str(tmp_path / "store"), spec=str(tmp_path / "spec.json"), world_size=2)
    with pytest.raises(StagingError, match=r"'layers.0.wq.weight' matches '\*.wq.\*' \(axis 0\) and "
                                           r"'\*.wq.weight' \(axis 1\)"):
        stage_sharded(str(src), str(tmp_path / "store"), spec="*.wq.*=0,*.wq.weight=1", world_size=2)
    assert not (tmp_path / "store").exists()
    # Overlapping and agreeing: both globs matched something, the cut is the same.
    stage_sharded(str(src), str(tmp_path / "store"), spec="*.wq.*=0,*.wq.weight=0,*.wo.weight=1", world_size=2)
    held = read_store(str(tmp_path / "store" / "rank_1"))
    np.testing.assert_array_equal(held["layers.0.wq.weight"], WHOLE["layers.0.wq.weight"][4:])


def test_a_plain_stage_of_one_rank_does_not_block_the_next_sharded_stage(tmp_path):
    """docs/distributed.md: a machine holding some ranks stages them with the plain verb
    (--store ROOT/rank_N). Its lock file beside rank_N, and the work directory of one that
    died, are the plain stage's own, not foreign content."""
    from prefetchd.staging import stage_checkpoint
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)
    one = tmp_path / "one.safetensors"
    write_safetensors(one, {"extra": np.arange(3, dtype=np.float32)})
    stage_checkpoint(str(one), str(tmp_path / "store" / "rank_1"))
    assert (tmp_path / "store" / ".rank_1.stage-lock").exists()
    (tmp_path / "store" / ".rank_1.staging-99999").mkdir()          # a plain stage that died
    second = stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)
    assert second["generation"] == 2
    assert not (tmp_path / "store" / ".rank_1.staging-99999").exists()
    # A file nobody staged is still refused.
    (tmp_path / "store" / "notes.txt").write_text("mine")
    with pytest.raises(StagingError, match="holds 'notes.txt'"):
        stage_sharded(str(src), str(tmp_path / "store"), spec=SPEC, world_size=2)


@pytest.mark.parametrize("before", ["lock file", "empty rank dir", "plain stage of rank 1"])
def test_a_first_sharded_stage_takes_a_root_holding_only_what_ranks_made(tmp_path, monkeypatch, before):
    """`rank_config` leaves a root that holds no tensors to the user (each rank's daemon makes
    its rank_N there), and docs/distributed.md has a machine stage its own ranks with the plain
    verb (--store ROOT/rank_N): `stage --shard` then refused that root ("holds files but no
    prefetchd-shards.json"). A root lock file, rank_N stores and their stage locks are taken
    into the first generation; a daemon opening the root as a plain store meanwhile is refused."""
    from prefetchd.staging import shards
    from prefetchd.backend.base import STORE_LOCK
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    root = tmp_path / "store"
    root.mkdir()
    if before == "lock file":
        (root / STORE_LOCK).touch()
    elif before == "empty rank dir":
        (root / "rank_1").mkdir()
    else:
        one = tmp_path / "one.safetensors"
        write_safetensors(one, {"extra": np.arange(3, dtype=np.float32)})
        stage_checkpoint(str(one), str(root / "rank_1"))
    seen = []
    real = shards.stage_into

    def stage_into(*args, **kwargs):
        seen.append(daemon_open_meets(root))
        return real(*args, **kwargs)
    monkeypatch.setattr(shards, "stage_into", stage_into)
    report = stage_sharded(str(src), str(root), spec=SPEC, world_size=2)
    assert report["generation"] == 1 and seen and all(f"in use by pid {os.getpid()}" in e for e in seen), seen
    assert json.load(open(root / SHARDS_FILE))["world_size"] == 2
    for r in (0, 1):
        held = set(read_store(str(root / f"rank_{r}")))
        assert held == set(WHOLE) | ({"extra"} if before == "plain stage of rank 1" and r == 1 else set())
    # What no rank made is still refused, and a rank beyond the world is no rank store.
    for name, make in (("notes.txt", lambda p: p.write_text("mine")), ("rank_2", lambda p: p.mkdir())):
        other = tmp_path / f"other-{name}"
        other.mkdir()
        make(other / name)
        with pytest.raises(StagingError, match=rf"holds '{name}', which is neither a rank store of 2 ranks"):
            stage_sharded(str(src), str(other), spec=SPEC, world_size=2)
        assert os.listdir(other) == [name]


def test_the_empty_rank_directories_of_a_killed_first_stage_are_removed_by_the_next(tmp_path):
    """A first `stage --shard --ranks 256` SIGKILLed before any rank was staged left 256
    rank_N directories holding only their lock files, and a stage of 2 ranks was refused
    ("holds 'rank_10', which is neither a rank store of 2 ranks...") until they were removed
    by hand (an outside probe). They hold nothing: the next stage removes them, but keeps
    one whose lock a daemon holds (and is refused by it, as before)."""
    import fcntl

    from prefetchd.backend.base import STORE_LOCK
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, WHOLE)
    root = tmp_path / "store"
    root.mkdir()
    (root / STORE_LOCK).write_text("")
    for r in range(10):                                   # what the killed stage made
        (root / f"rank_{r}").mkdir()
        (root / f"rank_{r}" / STORE_LOCK).write_text("123\n")
    held = os.open(root / "rank_5" / STORE_LOCK, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)                      # a daemon has rank_5 open
    try:
        with pytest.raises(StagingError, match="holds 'rank_5', which is neither"):
            stage_sharded(str(src), str(root), spec=SPEC, world_size=2)
    finally:
        os.close(held)
    assert sorted(os.listdir(root)) == sorted([STORE_LOCK, "rank_5"])       # the others held nothing
    stage_sharded(str(src), str(root), spec=SPEC, world_size=2)
    assert sorted(os.listdir(root)) == sorted([SHARDS_FILE, "rank_0", "rank_1"])
