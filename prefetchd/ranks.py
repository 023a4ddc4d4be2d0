"""Which rank this process is, and a Config of its own for it (docs/distributed.md).

A sharded model runs one process per rank (MindSpore's `msrun`, or any launcher
that sets its environment), each with a Daemon of its own. `detect()` reads the
rank and world size from `mindspore.communication` once it is initialized, else
from the environment msrun gives every worker before `init()`:

    RANK_ID      the rank (unset under msrun without --node_rank: then only init() knows it)
    RANK_SIZE / MS_WORKER_NUM   the world size
    DEVICE_ID    the worker's index on its machine (msrun's local rank; under other
                 launchers the device's index, as unique on the machine: all the port
                 offsets need)

`rank_config(config)` turns one Config into the rank's: its store is
`<store_dir>/rank_<N>` (what `prefetchd stage --shard` writes), its name gets
`.rank<N>` (the default control socket and log lines stay apart), its timeline
file gets `.rank<N>` before the suffix, and its metrics port and tcp control
port are offset by the local rank so the ranks of one machine do not collide.
Every sample and the status carry `rank`.
"""
import os
import re
import sys
from dataclasses import dataclass

from .config import Config
from .errors import ConfigError
from .backend.base import SHARDS_FILE, STORE_SUFFIX
from .staging import INDEX_FILE
from .staging.errors import StagingError
from .staging.generations import rank_mismatch, read_index
from .staging.shards import read_shards


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    source: str            # "mindspore.communication", "environment" or "argument"

    def __post_init__(self):
        if not 0 < self.world_size:
            raise ConfigError(f"world size must be >= 1, got {self.world_size} (from {self.source})")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside the world of {self.world_size} ranks "
                              f"(from {self.source})")
        if self.local_rank < 0:          # (not checked against the rank: DEVICE_ID=4 on rank 0 is fine)
            raise ConfigError(f"local rank {self.local_rank} must be >= 0 (from {self.source})")


def _env_int(env, key):
    value = env.get(key)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{key}={value!r} in the environment is not an integer") from None


def _from_communication():
    """RankInfo from mindspore.communication if this process called init(); else None.
    MindSpore is not imported here: a process that never imported it never initialized it."""
    if "mindspore.communication" not in sys.modules:
        return None
    from mindspore.communication import _comm_helper
    if not _comm_helper.GlobalComm.INITED:
        return None
    from mindspore.communication import get_group_size, get_local_rank, get_rank
    return RankInfo(get_rank(), get_group_size(), get_local_rank(), "mindspore.communication")


def detect(env=None):
    """This process's RankInfo, or None when it is not one of several ranks."""
    info = _from_communication()
    if info is not None:
        return info
    env = os.environ if env is None else env
    size, workers = _env_int(env, "RANK_SIZE"), _env_int(env, "MS_WORKER_NUM")
    if size is not None and workers is not None and size != workers:
        # (msrun exports both, equal: one left over from another job would pick the wrong shards)
        raise ConfigError(f"RANK_SIZE={size} and MS_WORKER_NUM={workers} disagree on the world size; "
                          f"unset the one left over from another job")
    size = workers if size is None else size
    rank = _env_int(env, "RANK_ID")
    if size is None and rank is None:
        return None
    if size is None:
        raise ConfigError(f"RANK_ID={rank} is set but neither RANK_SIZE nor MS_WORKER_NUM: "
                          f"the world size is unknown")
    if rank is None:
        raise ConfigError(f"a world of {size} ranks (RANK_SIZE/MS_WORKER_NUM) without RANK_ID: msrun "
                          f"assigns ranks at mindspore.communication.init() when --node_rank is not "
                          f"given; call init() before building the rank's daemon")
    local = _env_int(env, "DEVICE_ID")
    return RankInfo(rank, size, rank if local is None else local, "environment")


_IPC_SOCK = re.compile(r"^(ipc://.+?)(\.sock)?$")
_TCP_PORT = re.compile(r"^(tcp://.+:)(\d+)$")


def _suffixed(path, rank):
    """run.json -> run.rank1.json; a path without a suffix gets .rank1 at its end."""
    head, ext = os.path.splitext(path)
    return f"{head}.rank{rank}{ext}"


def _endpoint(endpoint, info):
    if endpoint is None or endpoint == "ipc://":
        return endpoint                 # ipc:// is <runtime dir>/<name>.sock: the name carries the rank
    if endpoint.startswith("ipc://"):
        m = _IPC_SOCK.match(endpoint)
        return f"{m.group(1)}.rank{info.rank}{m.group(2) or ''}"
    m = _TCP_PORT.match(endpoint)
    if m is None or int(m.group(2)) == 0:
        return endpoint                 # tcp://host:* or port 0: the system picks, no collision
    port = int(m.group(2)) + info.local_rank
    if port > 65535:
        raise ConfigError(f"endpoint {endpoint}: port + local rank {info.local_rank} is beyond 65535")
    return f"{m.group(1)}{port}"


def _entries(root):
    """The names in a store root ([] where it does not exist yet: the rank's daemon makes it)."""
    try:
        return os.listdir(root)
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise ConfigError(f"store_dir {root}: is not a directory") from None
    except OSError as e:     # unlisted, a plain store's tensors would go unseen: refuse, not guess
        raise ConfigError(f"store_dir {root}: cannot list it ({e.strerror}), so whether it is a sharded "
                          f"or a plain store is unknown") from None


def rank_store(root, info):
    """`root/rank_<N>`, this rank's store, after refusing a root no rank can read: a sharded
    store staged for another world size, or whose rank_<N> is missing, not its own directory
    (a symbolic link could be another rank's shard) or holds no index; a plain store (staged
    or written without --shard: its tensors are the whole model's, and a rank_N made inside it
    would start empty). A root that is neither is the user's: the rank's daemon makes its
    directory."""
    place = os.path.join(root, f"rank_{info.rank}")
    entries = _entries(root)
    if SHARDS_FILE in entries:
        try:
            shards = read_shards(root)
        except StagingError as e:
            raise ConfigError(str(e)) from None
        world = shards["world_size"]
        if world != info.world_size:
            raise ConfigError(f"store {root} was staged for {world} ranks, this job has {info.world_size} "
                              f"(stage it again with --ranks {info.world_size})")
        link = os.path.islink(place)
        if link or not os.path.isdir(place):
            what = "a symbolic link" if link else "removed, or not a directory"
            raise ConfigError(f"store {root} is staged for {world} ranks but has no {place} ({what}); "
                              f"stage it again with `prefetchd stage --shard`")
        if not os.path.exists(os.path.join(place, INDEX_FILE)):
            raise ConfigError(f"store {root} is staged for {world} ranks but {place} holds no {INDEX_FILE} "
                              f"(emptied?); stage it again with `prefetchd stage --shard`")
        ranks = shards.get("ranks")
        entry = ranks.get(str(info.rank)) if isinstance(ranks, dict) else None   # (a hand-edited document)
        return _own_shard(place, info.rank, entry.get("checkpoint") if isinstance(entry, dict) else None,
                          shards)
    if any(name == INDEX_FILE or name.endswith(STORE_SUFFIX) for name in entries):
        raise ConfigError(f"store {root} is a plain store (no {SHARDS_FILE}): a rank reads its shard from "
                          f"{root}/rank_N; stage the model with `prefetchd stage --shard`, or run it "
                          f"without ranks")
    return _own_shard(place, info.rank)


def _own_shard(place, rank, sharded_from=None, shards=None):
    """`place`, unless its index says it holds another rank's shard: staged from another
    rank's checkpoint (a plain `prefetchd stage rank_1/net.ckpt --store STORE/rank_0`, before
    stage refused it), or staged for another rank (its "rank": rank_1/ copied to rank_0/, an
    rsync of the wrong directory), or, in a sharded store (`shards`, its document), staged
    alone since the sharded stage (another generation: another version of the weights beside
    the other ranks'). What `stage --shard` staged there (`sharded_from`, its record) is this
    rank's by construction, wherever the file lies (one whole checkpoint split for every rank
    may sit in a rank_0/). Indexes written before they said a rank are taken as they are."""
    index = read_index(place)
    staged_from = str(index.get("checkpoint", ""))
    any_rank = index.get("any_rank") is True
    trusted = staged_from == sharded_from or any_rank
    why = None if trusted else rank_mismatch(staged_from, place)
    if why is not None:
        raise ConfigError(f"store {place}: {why}; stage it again from rank_N/'s file")
    staged_for = index.get("rank")
    if not any_rank and type(staged_for) is int and staged_for != rank:
        raise ConfigError(f"store {place} holds rank {staged_for}'s shard (its index says so: copied from "
                          f"rank_{staged_for}/?), and this is rank {rank}: it would compute with another "
                          f"rank's weights; stage it again with `prefetchd stage --shard`")
    generation, sharded = index.get("generation"), (shards or {}).get("generation")
    if type(generation) is int and type(sharded) is int and generation != sharded:
        raise ConfigError(f"store {place} was staged alone (generation {generation}, from {staged_from}) "
                          f"after the sharded stage of generation {sharded} (from {shards.get('source')}): "
                          f"its weights may be another version than the other ranks'; stage every rank again "
                          f"with `prefetchd stage --shard`, or, to run rank stores staged one by one, remove "
                          f"{os.path.join(os.path.dirname(place), SHARDS_FILE)}")
    return place


def _is_ranks(config):
    """Whether `config` is a rank's already (rank_config's result): its name and store carry the rank."""
    return (config.name.endswith(f".rank{config.rank}")
            and (config.store_dir is None or os.path.basename(os.path.normpath(config.store_dir))
                 == f"rank_{config.rank}"))


def rank_config(config=None, info=None, **overrides):
    """The Config of this rank's daemon: `config` (or Config.load(**overrides)) with a store,
    name, timeline, metrics port and endpoint of its own. info: a RankInfo (default detect());
    without ranks the config is returned as it is."""
    if config is None:
        config = Config.load(**overrides)
    elif overrides:
        config = config.replace(**overrides)
    if config.rank is not None:          # rank/world_size given as settings (file, PREFETCHD_RANK)
        found = detect() if info is None else info
        if found is not None and (found.rank, found.world_size) != (config.rank, config.world_size):
            # A leftover setting would open another rank's shard and ports: so would a whole rank's
            # config (its name and store too, as `prefetchd config show` prints it) on another rank.
            raise ConfigError(f"the settings say rank {config.rank} of {config.world_size} (rank, world_size: "
                              f"PREFETCHD_RANK/PREFETCHD_WORLD_SIZE or the config file), this process is "
                              f"rank {found.rank} of {found.world_size} (from {found.source}); unset one")
        mine = RankInfo(config.rank, config.world_size, config.rank if found is None else found.local_rank,
                        "config")
        if _is_ranks(config):            # a rank's config already: its store still checked
            if config.store_dir is not None:
                rank_store(os.path.dirname(os.path.normpath(config.store_dir)), mine)
            return config
        info = mine if info is None else info
    info = detect() if info is None else info
    if info is None:
        return config
    suffix = f".rank{info.rank}"         # (a name that has it already keeps one)
    changes = {"rank": info.rank, "world_size": info.world_size,
               "name": config.name if config.name.endswith(suffix) else config.name + suffix,
               "endpoint": _endpoint(config.endpoint, info)}
    if config.store_dir is not None:
        changes["store_dir"] = rank_store(config.store_dir, info)
    if config.trace is not None:
        changes["trace"] = _suffixed(config.trace, info.rank)
    if config.metrics_port:              # 0: any free port, never a collision
        port = config.metrics_port + info.local_rank
        if port > 65535:
            raise ConfigError(f"metrics_port {config.metrics_port} + local rank {info.local_rank} is beyond 65535")
        changes["metrics_port"] = port
    return config.replace(**changes)
