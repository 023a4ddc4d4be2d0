"""prefetchd.ranks: the rank from msrun's environment, a rank's own config, and the rank in
status, metrics and `prefetchd status` (a real Daemon, a real control socket)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import ENV, REPO
from prefetchd import Config, Daemon
from prefetchd.errors import ConfigError
from prefetchd.ranks import RankInfo, detect, rank_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "staging"))
from ckpt_files import write_safetensors  # noqa: E402

# What msrun --worker_num 2 --local_worker_num 2 exported to its second worker (printed by a
# script run under msrun on this machine; docs/distributed.md).
MSRUN_RANK1 = {"RANK_SIZE": "2", "RANK_ID": "1", "MS_WORKER_NUM": "2", "MS_ROLE": "MS_WORKER",
               "DEVICE_ID": "1", "MS_NODE_ID": "1", "MS_SCHED_HOST": "127.0.0.1", "MS_SCHED_PORT": "8118"}


def test_detect_reads_msruns_environment():
    assert detect({}) is None
    assert detect(MSRUN_RANK1) == RankInfo(1, 2, 1, "environment")
    # the second machine of two, one worker each: rank 1, local rank 0
    assert detect({"MS_WORKER_NUM": "2", "RANK_ID": "1", "DEVICE_ID": "0"}) == RankInfo(1, 2, 0, "environment")
    # A single-card job on card 4 (DEVICE_ID a device index, not msrun's local rank): refused before.
    assert detect({"RANK_SIZE": "1", "RANK_ID": "0", "DEVICE_ID": "4"}) == RankInfo(0, 1, 4, "environment")


@pytest.mark.parametrize("env, words", [
    ({"MS_WORKER_NUM": "4"}, "without RANK_ID"),
    ({"RANK_ID": "1"}, "world size is unknown"),
    ({"RANK_ID": "2", "RANK_SIZE": "2"}, "outside the world of 2"),
    ({"RANK_ID": "x", "RANK_SIZE": "2"}, "RANK_ID='x'"),
    ({"RANK_ID": "0", "RANK_SIZE": "2", "DEVICE_ID": "-1"}, "local rank -1 must be >= 0"),
    ({"RANK_ID": "1", "RANK_SIZE": "2", "MS_WORKER_NUM": "4"}, "RANK_SIZE=2 and MS_WORKER_NUM=4 disagree"),
])
def test_detect_refuses_an_environment_it_cannot_trust(env, words):
    with pytest.raises(ConfigError, match=words):
        detect(env)


def test_rank_config_gives_each_rank_its_own_store_name_trace_and_ports(tmp_path):
    base = Config.load(env={}, store_dir=str(tmp_path / "store"), trace=str(tmp_path / "run.json"),
                       metrics_port=9466, endpoint="tcp://127.0.0.1:5555", device_budget="8MiB")
    configs = [rank_config(base, RankInfo(r, 2, r, "argument")) for r in (0, 1)]
    for r, c in enumerate(configs):
        assert (c.rank, c.world_size) == (r, 2)
        assert c.store_dir == str(tmp_path / "store" / f"rank_{r}")
        assert c.name == f"default.rank{r}"
        assert c.trace == str(tmp_path / f"run.rank{r}.json")
        assert c.metrics_port == 9466 + r
        assert c.endpoint == f"tcp://127.0.0.1:{5555 + r}"
        assert c.device_budget == 8 << 20
    assert rank_config(configs[1]) is configs[1]            # already a rank's: not nested again
    ipc = rank_config(base.replace(endpoint="ipc:///run/pfd.sock"), RankInfo(1, 2, 1, "argument"))
    assert ipc.endpoint == "ipc:///run/pfd.rank1.sock"
    with pytest.raises(ConfigError, match="beyond 65535"):
        rank_config(base.replace(metrics_port=65535), RankInfo(1, 2, 1, "argument"))


def test_a_rank_given_as_settings_gets_its_own_paths_too(tmp_path):
    """PREFETCHD_RANK / PREFETCHD_WORLD_SIZE (no launcher environment): the same per-rank config."""
    env = {"PREFETCHD_RANK": "1", "PREFETCHD_WORLD_SIZE": "2", "PREFETCHD_STORE_DIR": str(tmp_path / "s")}
    config = rank_config(Config.load(env=env))
    assert (config.rank, config.store_dir, config.name) == (1, str(tmp_path / "s" / "rank_1"), "default.rank1")
    assert rank_config(config) is config


def test_config_refuses_half_a_rank(tmp_path):
    with pytest.raises(ConfigError, match=r"^rank: 0 is set without world_size; .*set together \(from argument\)$"):
        Config.load(env={}, rank=0)
    (tmp_path / "rank.toml").write_text("[prefetchd]\nrank = 1\n")    # says where it came from
    with pytest.raises(ConfigError, match=rf"rank: 1 is set without world_size.*\(from file {tmp_path}/rank.toml\)"):
        Config.load(str(tmp_path / "rank.toml"), env={})
    with pytest.raises(ConfigError, match=r"world_size: 2 is set without rank.*\(from env PREFETCHD_WORLD_SIZE\)"):
        Config.load(env={"PREFETCHD_WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match="outside the world"):
        Config.load(env={}, rank=2, world_size=2)


def test_rank_config_refuses_a_store_staged_for_another_world(tmp_path):
    from prefetchd.staging import SHARDS_FILE
    root = tmp_path / "store"
    root.mkdir()
    (root / SHARDS_FILE).write_text('{"format": 1, "world_size": 4}')
    with pytest.raises(ConfigError, match="staged for 4 ranks, this job has 2"):
        rank_config(Config.load(env={}, store_dir=str(root)), RankInfo(0, 2, 0, "argument"))
    # A rank's config already (its store root/rank_0) is checked the same way, not passed through.
    already = Config.load(env={}, store_dir=str(root / "rank_0"), name="default.rank0", rank=0, world_size=2)
    with pytest.raises(ConfigError, match="staged for 4 ranks, this job has 2"):
        rank_config(already)


def test_status_metrics_and_the_status_verb_carry_the_rank(tmp_path, ms):
    from prefetchd.telemetry.metrics import render
    endpoint = f"ipc://{tmp_path}/ctl.sock"
    config = rank_config(Config.load(env={}, store_dir=str(tmp_path / "store"), device_budget="4MiB",
                                     endpoint=endpoint), RankInfo(1, 2, 1, "argument"))
    with Daemon(config) as daemon:
        assert daemon.status()["rank"] == {"rank": 1, "world_size": 2}
        samples = [line for line in render(daemon).splitlines() if line.startswith("prefetchd_")]
        assert samples and all('daemon="default.rank1"' in line and 'rank="1"' in line for line in samples)
        out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "status", "--endpoint", config.endpoint],
                             capture_output=True, text=True, timeout=60, cwd=REPO, env=ENV)
        assert out.returncode == 0, out.stderr
        assert "daemon   default.rank1" in out.stdout and "rank 1 of 2" in out.stdout
    assert os.path.isdir(tmp_path / "store" / "rank_1")
    with Daemon(store_dir=str(tmp_path / "plain"), device_budget="4MiB") as plain:   # not a rank: no label
        assert plain.status()["rank"] is None
        assert 'rank="' not in render(plain)


def test_a_daemon_given_the_sharded_root_is_refused_and_leaves_no_lock(tmp_path):
    """Outside msrun rank_config returns the config as it is: a Daemon on the sharded root would
    start with no tensors and leave a store lock that the next `stage --shard` refuses."""
    from prefetchd.staging import SHARDS_FILE
    from prefetchd.errors import StorageError
    root = tmp_path / "store"
    root.mkdir()
    (root / SHARDS_FILE).write_text('{"format": 1, "world_size": 2}')
    with pytest.raises(StorageError, match=r"is a sharded store .*rank_config"):
        Daemon(Config.load(env={}, store_dir=str(root), device_budget="4MiB")).start()
    assert os.listdir(root) == [SHARDS_FILE]


def test_rank_settings_that_contradict_the_launcher_are_refused(tmp_path, monkeypatch):
    """A leftover PREFETCHD_RANK=1 under msrun's RANK_ID=0 would open rank 1's shard and ports."""
    monkeypatch.setenv("RANK_ID", "0")
    monkeypatch.setenv("RANK_SIZE", "2")
    env = {"PREFETCHD_RANK": "1", "PREFETCHD_WORLD_SIZE": "2", "PREFETCHD_STORE_DIR": str(tmp_path / "s")}
    with pytest.raises(ConfigError, match=r"settings say rank 1 of 2 .* this process is rank 0 of 2"):
        rank_config(Config.load(env=env))
    agreeing = {**env, "PREFETCHD_RANK": "0"}
    assert rank_config(Config.load(env=agreeing)).store_dir == str(tmp_path / "s" / "rank_0")


def test_a_whole_rank_config_reused_on_another_rank_is_refused(tmp_path, monkeypatch):
    """Rank 1's config as `prefetchd config show` prints it (rank, world size, name and store
    all rank 1's), reused on rank 0: it was taken as a rank's config already and returned as
    it was, so rank 0 opened rank 1's shard and the job computed a wrong answer without an
    error (an outside probe, with real msrun ranks)."""
    base = Config.load(env={}, store_dir=str(tmp_path / "s"))
    rank1 = rank_config(base, RankInfo(1, 2, 1, "argument"))
    assert rank_config(rank1) is rank1                               # no launcher: as it is
    monkeypatch.setenv("RANK_ID", "0")
    monkeypatch.setenv("RANK_SIZE", "2")
    with pytest.raises(ConfigError, match=r"settings say rank 1 of 2 .* this process is rank 0 of 2"):
        rank_config(rank1)
    with pytest.raises(ConfigError, match=r"settings say rank 1 of 2 .* this process is rank 0 of 2"):
        rank_config(rank1, RankInfo(0, 2, 0, "argument"))
    monkeypatch.setenv("RANK_ID", "1")
    assert rank_config(rank1) is rank1


def test_a_rank_job_on_a_plain_store_or_a_missing_shard_is_refused_naming_the_directory(tmp_path, ms):
    """A plain store's tensors are the whole model's: a rank_N made inside it would start empty and
    fail later on the first parameter (UnknownTensorError), leaving a directory the next plain stage
    of that store refuses. A sharded store without this rank's directory fails the same way."""
    from prefetchd.staging import stage_checkpoint, stage_sharded
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, {"w": np.arange(8, dtype=np.float32).reshape(2, 4)})
    staged, written, sharded = (str(tmp_path / name) for name in ("staged", "written", "sharded"))
    stage_checkpoint(str(src), staged)
    with Daemon(store_dir=written, device_budget="4MiB") as daemon:       # a daemon's own .pfd files
        daemon.register(ms.Tensor(np.ones(4, np.float32)), "w", tier="remote")
    for plain in (staged, written):
        before = sorted(os.listdir(plain))
        with pytest.raises(ConfigError, match=rf"store {plain} is a plain store .*{plain}/rank_N.*--shard"):
            rank_config(Config.load(env={}, store_dir=plain), RankInfo(0, 2, 0, "argument"))
        assert sorted(os.listdir(plain)) == before
    stage_sharded(str(src), sharded, spec="w=0", world_size=2)
    shutil.rmtree(os.path.join(sharded, "rank_1"))
    assert rank_config(Config.load(env={}, store_dir=sharded),
                       RankInfo(0, 2, 0, "argument")).store_dir == os.path.join(sharded, "rank_0")
    with pytest.raises(ConfigError, match=rf"staged for 2 ranks but has no {sharded}/rank_1"):
        rank_config(Config.load(env={}, store_dir=sharded), RankInfo(1, 2, 1, "argument"))
    # A directory that is no store yet, or holds only a lock file, is the user's: each rank makes its own.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / ".pfd-lock").touch()
    assert rank_config(Config.load(env={}, store_dir=str(fresh)),
                       RankInfo(1, 2, 1, "argument")).store_dir == str(fresh / "rank_1")


def test_a_sharded_store_whose_rank_directory_is_a_link_or_emptied_is_refused(tmp_path):
    """A rank_1 that is a link to rank_0 gave rank 1 rank 0's shard (wrong weights, no error);
    an emptied rank_1 failed later, on the job's first parameter."""
    from prefetchd.staging import SHARDS_FILE, stage_sharded
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, {"w": np.arange(8, dtype=np.float32).reshape(2, 4)})
    root = tmp_path / "sharded"
    stage_sharded(str(src), str(root), spec="w=0", world_size=2)
    config = Config.load(env={}, store_dir=str(root))
    shutil.rmtree(root / "rank_1")
    os.symlink("rank_0", root / "rank_1")
    with pytest.raises(ConfigError, match=rf"has no {root}/rank_1 \(a symbolic link\)"):
        rank_config(config, RankInfo(1, 2, 1, "argument"))
    os.unlink(root / "rank_1")
    (root / "rank_1").mkdir()
    with pytest.raises(ConfigError, match=rf"{root}/rank_1 holds no prefetchd-index.json"):
        rank_config(config, RankInfo(1, 2, 1, "argument"))
    (root / SHARDS_FILE).write_text('{"format": 1, "world_size": true}')       # not a world of 1
    with pytest.raises(ConfigError, match="not a prefetchd shards document"):
        rank_config(config, RankInfo(0, 1, 0, "argument"))


def test_rank_config_refuses_a_root_it_cannot_read_and_keeps_the_default_endpoint(tmp_path, monkeypatch):
    """An unlistable plain store was taken for the user's directory (a rank_N made inside it,
    found empty); a store path that is a file got a StagingError about prefetchd-shards.json;
    the default endpoint `ipc://` (the runtime dir's <name>.sock) raised AttributeError."""
    info = RankInfo(1, 2, 1, "argument")
    assert rank_config(Config.load(env={}, endpoint="ipc://"), info).endpoint == "ipc://"
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=rf"store_dir {tmp_path}/file: is not a directory"):
        rank_config(Config.load(env={}, store_dir=str(tmp_path / "file")), info)
    locked = str(tmp_path / "locked")
    os.mkdir(locked)
    listdir = os.listdir

    def unlistable(path="."):        # what a 0300 directory gives a user who is not root
        if str(path) == locked:
            raise PermissionError(13, "Permission denied", path)
        return listdir(path)
    monkeypatch.setattr(os, "listdir", unlistable)
    with pytest.raises(ConfigError, match=rf"store_dir {locked}: cannot list it \(Permission denied\)"):
        rank_config(Config.load(env={}, store_dir=locked), info)
    assert os.listdir(tmp_path) and listdir(locked) == []


def test_a_name_that_ends_like_a_ranks_does_not_skip_the_store_checks(tmp_path, ms):
    """With rank settings, a daemon named 'job.rank0' was taken for rank_config's own result:
    the plain store root was returned unchanged and opened as rank 0's shard."""
    plain = str(tmp_path / "plain")
    with Daemon(store_dir=plain, device_budget="4MiB") as daemon:
        daemon.register(ms.Tensor(np.ones(4, np.float32)), "w", tier="remote")
    env = {"PREFETCHD_RANK": "0", "PREFETCHD_WORLD_SIZE": "2", "PREFETCHD_NAME": "job.rank0"}
    with pytest.raises(ConfigError, match="is a plain store"):
        rank_config(Config.load(env=env, store_dir=plain))
    fresh = rank_config(Config.load(env=env, store_dir=str(tmp_path / "fresh")))
    assert (fresh.name, fresh.store_dir) == ("job.rank0", str(tmp_path / "fresh" / "rank_0"))
    assert rank_config(fresh) is fresh


def test_another_ranks_checkpoint_is_refused_by_stage_and_by_the_ranks_daemon(tmp_path):
    """docs/distributed.md has a machine stage its own ranks with the plain verb
    (`stage rank_3/net.ckpt --store STORE/rank_3`). A slip of the number (rank_1's file into
    rank_0) staged, and both ranks computed with rank 1's shard: wrong outputs, no error."""
    from prefetchd.staging import StagingError, stage_checkpoint
    from prefetchd.staging.generations import write_index
    ckpt = tmp_path / "ckpt"
    for r in (0, 1):
        (ckpt / f"rank_{r}").mkdir(parents=True)
        write_safetensors(ckpt / f"rank_{r}" / "net.safetensors", {"w": np.full(4, r, np.float32)})
    root = tmp_path / "store"
    with pytest.raises(StagingError, match=rf"is rank 1's checkpoint .* {root}/rank_0 is rank 0's store"):
        stage_checkpoint(str(ckpt / "rank_1" / "net.safetensors"), str(root / "rank_0"))
    assert not (root / "rank_0").exists()
    for r in (0, 1):                      # its own rank's file is fine
        stage_checkpoint(str(ckpt / f"rank_{r}" / "net.safetensors"), str(root / f"rank_{r}"))
        assert rank_config(Config.load(env={}, store_dir=str(root)),
                           RankInfo(r, 2, r, "argument")).store_dir == str(root / f"rank_{r}")
    # A store staged so before stage refused it: its rank's daemon refuses to open it.
    doc = json.load(open(root / "rank_0" / "prefetchd-index.json"))
    write_index(str(root / "rank_0"), doc["tensors"], doc["generation"],
                str(ckpt / "rank_1" / "net.safetensors"))
    with pytest.raises(ConfigError, match=rf"store {root}/rank_0: .* is rank 1's checkpoint"):
        rank_config(Config.load(env={}, store_dir=str(root)), RankInfo(0, 2, 0, "argument"))
    # A link to another rank's file is that file.
    (tmp_path / "latest.safetensors").symlink_to(ckpt / "rank_1" / "net.safetensors")
    with pytest.raises(StagingError, match="is rank 1's checkpoint"):
        stage_checkpoint(str(tmp_path / "latest.safetensors"), str(root / "rank_0"))
    # Data parallel: every rank holds the same weights, and --any-rank says so (kept in the index).
    replicas = tmp_path / "replicas"
    for r in (0, 1):
        stage_checkpoint(str(ckpt / "rank_0" / "net.safetensors"), str(replicas / f"rank_{r}"), any_rank=True)
        assert rank_config(Config.load(env={}, store_dir=str(replicas)),
                           RankInfo(r, 2, r, "argument")).store_dir == str(replicas / f"rank_{r}")


def test_a_whole_checkpoint_split_from_a_rank_0_directory_opens_on_every_rank(tmp_path):
    # MindSpore saves a single-device run's checkpoint under rank_0/: split for two ranks by
    # `stage --shard`, rank 1's store records it as its source, and is rank 1's all the same.
    from prefetchd.staging import stage_sharded
    (tmp_path / "run" / "rank_0").mkdir(parents=True)
    src = tmp_path / "run" / "rank_0" / "whole.safetensors"
    write_safetensors(src, {"w": np.arange(8, dtype=np.float32).reshape(2, 4)})
    root = tmp_path / "store"
    stage_sharded(str(src), str(root), spec="w=0", world_size=2)
    for r in (0, 1):
        assert rank_config(Config.load(env={}, store_dir=str(root)),
                           RankInfo(r, 2, r, "argument")).store_dir == str(root / f"rank_{r}")
    # A shards document whose rank entries are not objects (edited by hand) is read, not a crash.
    doc = json.load(open(root / "prefetchd-shards.json"))
    json.dump({**doc, "ranks": {"0": None, "1": "x"}}, open(root / "prefetchd-shards.json", "w"))
    with pytest.raises(ConfigError, match=r"rank_0/whole.safetensors is rank 0's checkpoint"):
        rank_config(Config.load(env={}, store_dir=str(root)), RankInfo(1, 2, 1, "argument"))


def test_a_copy_of_another_ranks_store_or_a_rank_restaged_alone_is_refused(tmp_path):
    """Two silent wrong answers an outside probe found under msrun (exit 0, outputs off by
    0.02): rank_1/ copied over rank_0/ (an rsync of the wrong directory) opened as rank 0's,
    since a rank's index said nothing of its rank; and rank_1 restaged alone with the plain
    verb from another checkpoint opened beside rank 0's older shard. The index now says whose
    shard it is, and a rank whose generation is not the sharded stage's is refused."""
    from prefetchd.staging import stage_checkpoint, stage_sharded
    src = tmp_path / "whole.safetensors"
    write_safetensors(src, {"w": np.arange(8, dtype=np.float32).reshape(2, 4)})
    root = tmp_path / "sharded"
    stage_sharded(str(src), str(root), spec="w=0", world_size=2)
    config = Config.load(env={}, store_dir=str(root))
    assert [json.load(open(root / f"rank_{r}" / "prefetchd-index.json"))["rank"] for r in (0, 1)] == [0, 1]
    shutil.rmtree(root / "rank_0")
    shutil.copytree(root / "rank_1", root / "rank_0")
    with pytest.raises(ConfigError, match=rf"store {root}/rank_0 holds rank 1's shard .* this is rank 0"):
        rank_config(config, RankInfo(0, 2, 0, "argument"))
    assert rank_config(config, RankInfo(1, 2, 1, "argument")).store_dir == str(root / "rank_1")

    stage_sharded(str(src), str(root), spec="w=0", world_size=2)      # whole again
    newer = tmp_path / "ckpt" / "rank_1" / "net.safetensors"
    newer.parent.mkdir(parents=True)
    write_safetensors(newer, {"w": np.full((1, 4), 7, np.float32)})
    stage_checkpoint(str(newer), str(root / "rank_1"))
    with pytest.raises(ConfigError, match=rf"store {root}/rank_1 was staged alone \(generation 3, from .*\) "
                                          rf"after the sharded stage of generation 2"):
        rank_config(config, RankInfo(1, 2, 1, "argument"))
    os.unlink(root / "prefetchd-shards.json")          # rank stores staged one by one: the user's call
    assert rank_config(config, RankInfo(1, 2, 1, "argument")).store_dir == str(root / "rank_1")
