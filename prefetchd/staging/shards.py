"""`stage_sharded`: the per-rank stores of a sharded model, staged as one generation.

A sharded store is a directory of rank stores, `rank_0/ ... rank_<N-1>/` (each an
ordinary store directory with its own index), and `prefetchd-shards.json` saying
how many ranks and from what. The ranks come from either

- per-rank checkpoints: a directory in MindSpore's distributed layout, one file per
  rank (`rank_0/net.ckpt`, `rank_1/net.ckpt`, ...), each staged into its rank's store; or
- one checkpoint and a sharding spec: `GLOB=AXIS` pairs (fnmatch globs over parameter
  names): a tensor whose name matches is cut into N equal slices along AXIS, slice r
  for rank r (a Dense weight is [out, in]: column-parallel splits axis 0, row-parallel
  axis 1); a tensor no glob matches is replicated to every rank.

All or none across ranks: every rank store is built in one sibling work directory
(hard links to the current generation, as `generations` does for one store), and one
rename swaps the whole sharded directory, so a rank that fails (a damaged file, a
shape that does not divide) leaves no rank with a new generation. A rank's daemon
(`prefetchd.ranks.rank_config`) opens only `rank_<N>`: its reads are its shard's bytes.
"""
import contextlib
import fnmatch
import json
import os
import re
import shutil
import time

import numpy as np

from ..backend.base import SHARDS_FILE, STORE_LOCK
from ..limits import raise_open_files
from ..errors import DuplicateKey, unique_keys
from .errors import StagingError
from .generations import (RANK_DIR, fsync_dir, hold_store_lock, link_current, remove_leftovers, stage_into,
                          stage_lock, store_place, swap_in)
from .readers import iter_checkpoint

SHARDS_FORMAT = 1
PER_RANK = "per-rank"
_CHECKPOINT_SUFFIXES = (".ckpt", ".safetensors")
_PLAIN_STAGE_SIBLING = re.compile(r"^\.rank_(\d+)\.(?:stage-lock|staging-.+|retired-.+)$")


def read_shards(root):
    """The shards document of a sharded store directory, or None if it has none."""
    try:
        with open(os.path.join(root, SHARDS_FILE)) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise StagingError(f"{root}/{SHARDS_FILE}: unreadable ({e})") from None
    world = doc.get("world_size") if isinstance(doc, dict) else None
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise StagingError(f"{root}/{SHARDS_FILE}: not a prefetchd shards document (no world_size)")
    return doc


def parse_spec(text):
    """[(glob, axis)] from "GLOB=AXIS,GLOB=AXIS" or from a JSON file {"GLOB": AXIS}."""
    if os.path.isfile(text):
        try:
            with open(text) as f:
                doc = json.load(f, object_pairs_hook=unique_keys)
        except DuplicateKey as e:
            raise StagingError(f"sharding spec {e.key!r} is given twice") from None
        except (OSError, ValueError) as e:
            raise StagingError(f"sharding spec {text}: unreadable ({e})") from None
        if not isinstance(doc, dict):
            raise StagingError(f"sharding spec {text}: expected a JSON object {{\"GLOB\": AXIS}}")
        # A JSON axis is a number already: "0", 1.7 or true is a mistake, not axis 0 or 1.
        for glob, axis in doc.items():
            if isinstance(axis, bool) or not isinstance(axis, int):
                raise StagingError(f"sharding spec {glob!r}: axis {axis!r} is not an integer")
        pairs = list(doc.items())
    else:
        pairs = []
        for item in filter(None, (p.strip() for p in text.split(","))):
            glob, sep, axis = item.rpartition("=")
            if not sep or not glob:
                if "=" not in text and text.endswith(".json"):     # a spec file's name, mistyped
                    raise StagingError(f"sharding spec {text}: no such file (a spec is a JSON file "
                                       f"{{\"GLOB\": AXIS}} or GLOB=AXIS,...)")
                raise StagingError(f"sharding spec {item!r}: expected GLOB=AXIS (e.g. '*.wq.weight=0')")
            pairs.append((glob, axis))
    spec, seen = [], set()
    for glob, axis in pairs:
        try:
            axis = int(axis)
        except ValueError:
            raise StagingError(f"sharding spec {glob!r}: axis {axis!r} is not an integer") from None
        if axis < 0:
            raise StagingError(f"sharding spec {glob!r}: axis {axis} must be >= 0")
        if glob in seen:
            raise StagingError(f"sharding spec {glob!r} is given twice")
        seen.add(glob)
        spec.append((glob, axis))
    if not spec:
        raise StagingError(f"sharding spec {text!r}: names no GLOB=AXIS pair")
    return spec


def rank_checkpoints(directory):
    """[path of rank 0's file, rank 1's, ...] of a per-rank checkpoint directory."""
    ranks, names = {}, {}
    for entry in os.scandir(directory):
        m = RANK_DIR.match(entry.name)
        if m and entry.is_dir():
            rank = int(m.group(1))
            if rank in names:           # rank_2 and rank_0002: which is rank 2 is a guess
                first, second = sorted((names[rank], entry.name))
                raise StagingError(f"{directory}: {first}/ and {second}/ both name rank {rank}; "
                                   f"remove the one that is not")
            names[rank] = entry.name
            files = sorted(f for f in os.listdir(entry.path) if f.endswith(_CHECKPOINT_SUFFIXES))
            if len(files) != 1:
                raise StagingError(f"{entry.path}: holds {len(files)} checkpoint files "
                                   f"({', '.join(files) or 'none'}); a rank directory holds exactly one")
            ranks[rank] = os.path.join(entry.path, files[0])
    if not ranks:
        raise StagingError(f"{directory}: no rank_<N>/ subdirectories (MindSpore's distributed checkpoint "
                           f"layout: rank_0/net.ckpt, rank_1/net.ckpt, ...)")
    missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
    if missing:
        raise StagingError(f"{directory}: rank_{missing[0]}/ is missing (ranks must be 0..{max(ranks)})")
    return [ranks[r] for r in range(len(ranks))]


class RankSlice:
    """Iterator of rank `rank`'s (name, shape, dtype, buffer) out of one whole checkpoint."""

    def __init__(self, path, spec, rank, world_size):
        self.reader = iter_checkpoint(path)
        self.path, self.spec, self.rank, self.world_size = str(path), spec, rank, world_size
        self.tensors = getattr(self.reader, "tensors", None)
        self.nbytes = None                      # unknown until the spec meets the shapes

    def __iter__(self):
        for name, shape, dtype, data in self.reader:
            shape = tuple(int(d) for d in shape)
            axis = cut_axis(self.path, self.spec, name, shape, self.world_size)
            if axis is None:
                yield name, shape, dtype, data          # replicated
                continue
            itemsize = np.dtype(dtype).itemsize
            # By bytes (a trailing axis of itemsize): any dtype, bfloat16 included, slices the same.
            raw = np.frombuffer(data, np.uint8).reshape(*shape, itemsize)
            part = np.ascontiguousarray(np.split(raw, self.world_size, axis=axis)[self.rank])
            out = list(shape)
            out[axis] //= self.world_size
            yield name, tuple(out), dtype, part

    def close(self):
        self.reader.close()


def cut_axis(path, spec, name, shape, world_size):
    """The axis `spec` cuts tensor `name` of `shape` along (None: replicated), or StagingError.
    Globs may overlap where they agree; two that cut one tensor along different axes are
    refused, whichever comes first."""
    found = None
    for glob, axis in spec:
        if fnmatch.fnmatchcase(name, glob):
            if found is not None and found[1] != axis:
                raise StagingError(f"sharding spec: tensor {name!r} matches {found[0]!r} (axis {found[1]}) "
                                   f"and {glob!r} (axis {axis}); make the globs agree or not overlap")
            found = found or (glob, axis)
    if found is None:
        return None
    axis = found[1]
    if axis >= len(shape):
        raise StagingError(f"{path}: tensor {name!r} of shape {list(shape)} has no axis {axis} (sharding spec)")
    if shape[axis] % world_size:
        raise StagingError(f"{path}: tensor {name!r} axis {axis} of size {shape[axis]} does not divide "
                           f"into {world_size} ranks")
    return axis


def _check_spec(source, spec, world_size):
    """Refuse, from `source`'s structure and before any directory is made, a glob that matches
    no tensor and a tensor the spec cannot cut into `world_size` ranks (found while staging,
    they came after rank 0's whole stage, and left rank directories behind)."""
    reader = iter_checkpoint(source)
    try:
        shapes = reader.shapes
    finally:
        reader.close()
    for glob, _ in spec:
        if not any(fnmatch.fnmatchcase(name, glob) for name in shapes):
            raise StagingError(f"sharding spec {glob!r} matches no tensor of {source}")
    for name, shape in shapes.items():
        cut_axis(source, spec, name, tuple(int(d) for d in shape), world_size)


def _check_open_files(world_size):
    """A stage holds every rank's lock at once: refuse, before any is taken, a world the
    open-file limit cannot hold (the limit hit halfway left rank directories behind)."""
    need = world_size + 64                 # the ranks' locks, and the files each stage opens
    hard = raise_open_files(need)
    if hard is not None:
        raise StagingError(f"staging {world_size} ranks holds one lock per rank, and the open-file limit "
                           f"is {hard}: raise it (ulimit -n {need}) or stage fewer ranks")


def stage_sharded(source, store_dir, *, spec=None, world_size=None, progress=False, config=None,
                  progress_stream=None):
    """Stage a sharded model into `store_dir` (rank_<N>/ stores) as one generation; a report dict.

    source: a per-rank checkpoint directory (spec None), or one checkpoint file with `spec`
    (parse_spec's list, or its text) and `world_size`. StagingError (file and field named)
    leaves every rank's store as it was.
    """
    from ..config import Config
    started = time.monotonic()
    if spec is None:
        if not os.path.isdir(source):
            raise StagingError(f"{source}: per-rank staging takes a directory of rank_<N>/ checkpoints "
                               f"(or give a sharding spec to split one checkpoint)")
        if world_size is not None:
            raise StagingError(f"{source}: per-rank checkpoints give their own number of ranks; "
                               f"--ranks is for splitting one checkpoint")
        files = rank_checkpoints(source)
        world_size = len(files)
        for f in files:
            iter_checkpoint(f).close()           # every file's structure, before any is staged
        sources = [lambda f=f: iter_checkpoint(f) for f in files]
        described = PER_RANK
    else:
        spec = parse_spec(spec) if isinstance(spec, str) else spec
        if not isinstance(world_size, int) or world_size < 1:
            raise StagingError(f"splitting {source} needs the number of ranks (--ranks N, N >= 1)")
        _check_spec(source, spec, world_size)
        sources = [lambda r=r: RankSlice(source, spec, r, world_size) for r in range(world_size)]
        files, described = [str(source)] * world_size, {glob: axis for glob, axis in spec}
    _check_open_files(world_size)
    root, parent, base, work = store_place(store_dir)
    with stage_lock(parent, base), contextlib.ExitStack() as rank_stages:
        remove_leftovers(parent, base)
        _remove_empty_rank_dirs(root)
        previous = _check_root(root, world_size)
        if os.path.isdir(root):
            # A machine stages its own ranks with the plain verb (--store ROOT/rank_N): refuse
            # while one runs, and clear what one that died left. Only a lock file such a stage
            # made is taken (making one would change the root of a stage that then fails).
            for rank in range(world_size):
                if os.path.exists(os.path.join(root, f".rank_{rank}.stage-lock")):
                    rank_stages.enter_context(stage_lock(root, f"rank_{rank}"))
                remove_leftovers(root, f"rank_{rank}")
        os.mkdir(work, 0o700)
        locks, swapped = [], False
        # A root made here, and each rank directory (hold_store_lock), so that the ranks'
        # locks keep daemons out of them from the start; removed again if the stage fails.
        root_made = not os.path.exists(root)
        if root_made:
            os.mkdir(root, 0o700)
        try:
            config = config or Config.load()
            generation = (previous or {}).get("generation", 0) + 1
            ranks = {}
            stores = [os.path.join(root, f"rank_{r}") for r in range(world_size)]
            if previous is None:
                # Not sharded yet, the root could be opened as a plain store: its lock keeps
                # daemons out too, until the swap puts SHARDS_FILE there (open_store refuses that).
                stores.insert(0, root)
            for store in stores:                   # every rank's, before any is staged
                lock = hold_store_lock(store)
                if lock is not None:
                    locks.append(lock)
            for rank, make in enumerate(sources):
                rank_dir = os.path.join(root, f"rank_{rank}")
                rank_work = os.path.join(work, f"rank_{rank}")
                link_current(rank_dir, rank_work)
                reader = make()
                try:
                    report = stage_into(rank_work, reader, config.replace(store_dir=rank_work),
                                         progress, None, progress_stream, generation=generation,
                                         source=files[rank], label=f"prefetchd stage rank {rank}", rank=rank)
                finally:
                    reader.close()
                ranks[str(rank)] = {"checkpoint": files[rank], "tensors": report["tensors"],
                                    "bytes": report["bytes"]}
            _write_shards(work, {"format": SHARDS_FORMAT, "world_size": world_size, "generation": generation,
                                 "source": str(source), "spec": described, "ranks": ranks})
            swap_in(work, root, parent, base)
            swapped = True
        finally:
            shutil.rmtree(work, ignore_errors=True)
            for lock in locks:
                lock.release(swapped)
            if root_made and not swapped:
                with contextlib.suppress(OSError):
                    os.rmdir(root)                 # empty once its rank directories went
    seconds = time.monotonic() - started
    total = sum(r["bytes"] for r in ranks.values())
    return {"checkpoint": str(source), "store": root, "world_size": world_size, "generation": generation,
            "ranks": ranks, "bytes": total, "seconds": round(seconds, 3),
            "MBps": round(total / max(seconds, 1e-9) / 1e6, 1)}


def _check_root(root, world_size):
    """The current shards document (None: no store yet); refuse a root that is not a sharded store
    of this many ranks (restaging it with another world size would leave stale ranks behind)."""
    if not os.path.exists(root):
        return None
    if not os.path.isdir(root):
        raise StagingError(f"{root}: the store path exists and is not a directory")
    if os.path.ismount(root):
        raise StagingError(f"{root}: is a mount point; stage into a directory inside it")
    entries = set(os.listdir(root))
    doc = read_shards(root)
    if doc is not None and doc["world_size"] != world_size:
        raise StagingError(f"{root}: a sharded store of {doc['world_size']} ranks; staging {world_size} ranks "
                           f"needs a new directory")
    # Not sharded yet, it may hold what ranks' daemons or plain stages of single ranks made
    # (rank_N stores, their stage locks, the root's own lock file), all taken into the first
    # generation; anything else is not ours to replace.
    ours = {SHARDS_FILE} | {f"rank_{r}" for r in range(world_size)} | (set() if doc else {STORE_LOCK})
    stray = sorted(e for e in entries - ours if not _plain_stage_sibling(e, world_size))
    if stray:
        what = "a rank store" if doc else f"a rank store of {world_size} ranks"
        raise StagingError(f"{root}: holds {stray[0]!r}, which is neither {what} nor {SHARDS_FILE}"
                           + ("" if doc else ": not a sharded store; stage a sharded model into a new directory"))
    return doc


def _remove_empty_rank_dirs(root):
    """A first `stage --shard` killed midway (SIGKILL: no cleanup) leaves the rank_N
    directories it made before any rank was staged, each holding only its lock file, and
    a stage of another world size was then refused until they were removed by hand. Such
    a directory holds nothing: removed here, its lock held meanwhile (one a daemon has open
    is kept). Not in a sharded store: its rank stores are its generation's. (A directory
    with no lock file is no stage's: refused as before.)"""
    if not os.path.isdir(root) or os.path.exists(os.path.join(root, SHARDS_FILE)):
        return
    for entry in os.scandir(root):
        if not (RANK_DIR.match(entry.name) and entry.is_dir(follow_symlinks=False)):
            continue
        if os.listdir(entry.path) != [STORE_LOCK]:
            continue                                   # a rank store, or not ours (an empty one too)
        try:
            lock = hold_store_lock(entry.path)
        except StagingError:
            continue                                   # a daemon has it open (or it cannot be opened)
        if lock is None:
            continue                                   # gone meanwhile
        try:
            shutil.rmtree(entry.path, ignore_errors=True)
        finally:
            lock.release(swapped=False)                # (it made nothing there: this only lets go)


def _plain_stage_sibling(entry, world_size):
    """A plain stage of one rank (--store ROOT/rank_N) keeps its lock beside rank_N, and one
    that died leaves its work directory there (generations.py names both)."""
    m = _PLAIN_STAGE_SIBLING.match(entry)
    return m is not None and int(m.group(1)) < world_size


def _write_shards(work, doc):
    with open(os.path.join(work, SHARDS_FILE), "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(work)
