"""`stage_checkpoint`: a store directory replaced by a complete new generation, or left alone.

The store directory is never written in place. The next generation is built
in a sibling work directory `.<name>.staging-<pid>`: hard links to every file
of the current generation (no data copied: a FileStore never modifies a file,
it writes a new version and unlinks the old one, so the current generation's
files stay as they are), then the checkpoint's tensors written through a
FileStore opened there, each of them then read back from the disk with every
extent's CRC32C checked (as write-backs are), then an index listing exactly
what that store holds. A failed write or read-back is a StagingError naming
the checkpoint, and the store keeps its generation. Only then does one
renameat2(RENAME_EXCHANGE) swap it with the store
directory; the previous generation, now at the work path, is deleted. A
stage killed before the swap leaves the store directory as it was, index
included; the next stage deletes the leftover work directory. A daemon that
had the store open keeps its open files; it should reopen the store to see
the new generation.

The steps (store_place, stage_lock, remove_leftovers, hold_store_lock,
link_current, stage_into, swap_in) are public: `shards` builds several rank stores with
them and swaps their parent directory in one step instead.
"""
import contextlib
import ctypes
import errno
import fcntl
import glob
import json
import mmap
import os
import re
import shutil
import stat
import time

from ..backend.base import STORE_LOCK, open_store
from .errors import StagingError
from .progress import Progress
from .readers import iter_checkpoint
from .writer import meta_fields, stage_tensors
from . import load_markers

INDEX_FILE = "prefetchd-index.json"
INDEX_FORMAT = 1
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_PROBE_PREFIX = ".pfd-probe-"
_QUARANTINE = "quarantine"        # files a FileStore's recovery could not use, kept for people
_PAGE = mmap.PAGESIZE


RANK_DIR = re.compile(r"^rank_(\d+)$")      # MindSpore's distributed checkpoint layout


def rank_of_path(path):
    """The rank a path names by that layout (its deepest rank_<N> directory), or None."""
    for part in reversed(os.path.normpath(path).split(os.sep)[:-1]):
        m = RANK_DIR.match(part)
        if m:
            return int(m.group(1))
    return None


def rank_of_store(store_dir):
    """The rank a store directory is for by its name (STORE/rank_<N>), or None."""
    m = RANK_DIR.match(os.path.basename(os.path.normpath(store_dir)))
    return int(m.group(1)) if m else None


def rank_mismatch(checkpoint, store_dir):
    """Why staging `checkpoint` into `store_dir` would give a rank another rank's shard
    (rank_1/net.ckpt into STORE/rank_0, a slip outputs would never show), or None."""
    store, source = rank_of_store(store_dir), rank_of_path(checkpoint)
    if store is None or source is None or source == store:
        return None
    return (f"{checkpoint} is rank {source}'s checkpoint (its rank_{source}/ directory) and "
            f"{store_dir} is rank {store}'s store: that rank would compute with another "
            f"rank's shard")


def write_index(directory, index, generation=None, source=None, any_rank=False, rank=None):
    """Atomically replace `directory`'s index: {"format", "tensors": {name: {shape, dtype, nbytes}}};
    `any_rank`: the source is every rank's (staged with --any-rank), whatever rank it names;
    `rank`: the rank whose shard it holds (a copy of rank_1/ put at rank_0/ is refused by it)."""
    doc = {"format": INDEX_FORMAT, "tensors": index}
    if generation is not None:
        doc["generation"] = generation
    if source is not None:
        doc["checkpoint"] = source
    if any_rank:
        doc["any_rank"] = True
    elif rank is not None:
        doc["rank"] = rank
    tmp = os.path.join(directory, INDEX_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, INDEX_FILE))
    fsync_dir(directory)


def read_index(directory):
    """The index document of a store directory; {} if it has none or it is unreadable."""
    try:
        with open(os.path.join(directory, INDEX_FILE)) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def stage_checkpoint(path, store_dir, progress=False, *, config=None, progress_interval=None,
                     progress_stream=None, any_rank=False):
    """Import a .ckpt or .safetensors file into the store at `store_dir`, as one new generation.

    progress: False, or True for progress lines on `progress_stream` (stderr):
    a `\\r` line on a terminal, a line every `progress_interval` seconds
    (default 5) otherwise. config: a prefetchd Config for the store's I/O
    settings (default Config.load(): file and PREFETCHD_* env). Tensors the
    store held and the checkpoint does not name are kept. Returns a report
    dict; raises StagingError (file and field named) and leaves the store as
    it was on any failure, a checksum mismatch found at the end included.
    """
    from ..config import Config
    started = time.monotonic()
    mismatch = None if any_rank else (rank_mismatch(os.path.abspath(path), store_dir)
                                      or rank_mismatch(os.path.realpath(path), store_dir))
    if mismatch is not None:
        raise StagingError(f"{mismatch}; stage rank_N/'s file into STORE/rank_N, or, where every rank "
                           f"holds the same weights (data parallel), pass --any-rank")
    checkpoint = iter_checkpoint(path)                 # structure checked before the store is touched
    try:
        store_dir, parent, base, work = store_place(store_dir)
        with stage_lock(parent, base):
            remove_leftovers(parent, base)
            store_lock, swapped = None, False
            try:
                store_lock = hold_store_lock(store_dir)
                previous = link_current(store_dir, work)
                config = (config or Config.load()).replace(store_dir=work)
                report = stage_into(work, checkpoint, config, progress, progress_interval, progress_stream,
                                     generation=previous.get("generation", 0) + 1, source=str(path),
                                     any_rank=any_rank, rank=rank_of_store(store_dir))
                swap_in(work, store_dir, parent, base)
                swapped = True
            finally:
                shutil.rmtree(work, ignore_errors=True)
                if store_lock is not None:
                    store_lock.release(swapped)
    finally:
        checkpoint.close()
    seconds = time.monotonic() - started
    report.update(checkpoint=str(path), store=store_dir, seconds=round(seconds, 3),
                  MBps=round(report["bytes"] / max(seconds, 1e-9) / 1e6, 1))
    return report


def store_place(store_dir):
    """(store_dir resolved, its parent, its name, this process' work directory beside it):
    where a stage builds the new generation. The parent is made if missing; a filesystem
    root is refused (there is nowhere beside it to build)."""
    store_dir = os.path.realpath(store_dir)
    parent, base = os.path.split(store_dir)
    if not base:
        raise StagingError(f"{store_dir}: a filesystem root cannot be a store directory")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        why = "a path in it is not a directory" if isinstance(e, FileExistsError) else e.strerror or e
        raise StagingError(f"{store_dir}: cannot make the directory it goes in, {parent}: {why}") from None
    return store_dir, parent, base, os.path.join(parent, f".{base}.staging-{os.getpid()}")


def stage_into(work, checkpoint, config, progress, interval, stream, generation, source,
               label="prefetchd stage", any_rank=False, rank=None):
    store = open_store(config)
    try:
        if progress:
            progress = Progress(checkpoint.nbytes, checkpoint.tensors, stream=stream, interval=interval,
                                label=label)
        from .._native import NativeError
        try:
            staged = stage_tensors(store, checkpoint, progress)
        except StagingError as e:
            if str(e).startswith(source):
                raise
            raise StagingError(f"{source}: {e}") from None
        except NativeError as e:             # a write failed (ENOSPC, EIO, EFBIG): its message names the key
            raise StagingError(f"{source}: writing the new generation failed ({e}); nothing was swapped "
                               f"in, {_kept(generation)}") from None
        _read_back(store, staged, source, generation)
        index = {}
        for key in store.keys():             # exactly what this generation holds
            if key in staged:
                index[key] = staged[key]
                continue
            info = store.info(key)
            try:
                shape, dtype = meta_fields(info)
            except StagingError:
                continue                     # not a prefetchd tensor: kept, not indexed
            index[key] = {"shape": list(shape), "dtype": dtype, "nbytes": info["nbytes"]}
    finally:
        store.close()
    load_markers.forget_staged(work, staged)       # written whole: no longer mixed by a cut-short load
    write_index(work, index, generation=generation, source=source, any_rank=any_rank, rank=rank)
    return {"tensors": len(staged), "bytes": sum(t["nbytes"] for t in staged.values()),
            "generation": generation, "store_tensors": len(index)}


def _read_back(store, staged, source, generation):
    """Read every tensor just written back from the disk, checking each extent's CRC32C, before
    the new generation may replace the old one (write-backs are verified the same way): a
    mismatch or an I/O error refuses the stage, and the previous generation stays in place."""
    from .._native import NativeError
    if not staged:
        return
    largest = max(t["nbytes"] for t in staged.values())
    buf = mmap.mmap(-1, max(largest + _PAGE - 1, _PAGE) // _PAGE * _PAGE)   # page-aligned: no bounce
    try:
        for name, t in staged.items():
            try:
                store.read_sync(name, buf, verify=True)
            except NativeError as e:
                raise StagingError(f"{source}: tensor {name!r} read back wrong from the new generation "
                                   f"({e}); nothing was swapped in, {_kept(generation)}") from None
            buf.madvise(mmap.MADV_DONTNEED)     # one tensor's pages in RAM at a time
    finally:
        buf.close()


def _kept(generation):
    """What a failed stage of `generation` left (generation 0: no stage made the store before)."""
    return f"the store keeps generation {generation - 1}" if generation > 1 else \
        "the store is as it was before (none, if there was none)"


def link_current(store_dir, work):
    """Hard-link the current generation's files into a fresh `work` (the store directory's
    mode, 0700 for a new one); returns its index document."""
    os.mkdir(work, 0o700)
    if not os.path.exists(store_dir):
        return {}
    if not os.path.isdir(store_dir):
        raise StagingError(f"{store_dir}: the store path exists and is not a directory")
    os.chmod(work, stat.S_IMODE(os.stat(store_dir).st_mode))
    if os.path.ismount(store_dir):
        raise StagingError(f"{store_dir}: is a mount point; stage into a directory inside it "
                           f"(a generation is swapped in by renaming)")
    _link_files(store_dir, work)
    return read_index(store_dir)


def _link_files(src, dst, top=True):
    for entry in os.scandir(src):
        if entry.is_dir(follow_symlinks=False):
            if top and entry.name == _QUARANTINE:
                os.mkdir(os.path.join(dst, entry.name))
                _link_files(entry.path, os.path.join(dst, entry.name), top=False)
                continue
            raise StagingError(f"{src}: holds a subdirectory {entry.name!r}; "
                               f"a store directory holds only prefetchd files")
        if top and (entry.name in (INDEX_FILE, INDEX_FILE + ".tmp", STORE_LOCK) or entry.name.endswith(".tmp")
                    or entry.name.startswith(_PROBE_PREFIX)):
            continue
        os.link(entry.path, os.path.join(dst, entry.name), follow_symlinks=False)


class StoreLock:
    """The store's own FileStore lock (`.pfd-lock`), held by a stage (see hold_store_lock)."""

    def __init__(self, fd, store_dir, made, lock_made):
        self.fd, self.store_dir, self.made, self.lock_made = fd, store_dir, made, lock_made

    def release(self, swapped):
        """Let go; a store directory, or lock file, this stage made and did not swap a generation
        into goes first (nothing else wrote there: the lock kept every daemon out, until it is
        let go). A lock file left in a directory the stage refused (a sharded root) blocked every
        later `stage --shard` of it, as a file that is no rank store."""
        if self.made and not swapped:
            shutil.rmtree(self.store_dir, ignore_errors=True)
        elif self.lock_made and not swapped:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.store_dir, STORE_LOCK))
        os.close(self.fd)


def hold_store_lock(store_dir):
    """Take the store's own FileStore lock (a StoreLock; None where the path is not a
    directory: link_current says so): refuse if a daemon has it open, and keep any from
    opening the store until the swap is done. The lock file is made if the store has none
    yet (a store no daemon opened since its stage), and a store directory that does not
    exist yet is made here (mode 0700, as a FileStore makes one), so that the lock covers
    the store from the start: a daemon that opened the path during the stage made the
    directory or the lock itself and wrote its tensors there, and the swap then retired
    that directory with them, deleted."""
    made = False
    try:
        os.mkdir(store_dir, 0o700)
        made = True
    except (FileExistsError, FileNotFoundError, NotADirectoryError):
        pass                          # there already; or its parent is not there (link_current says so)
    except OSError as e:
        raise StagingError(f"{store_dir}: cannot make the store directory: {e.strerror}") from None
    lock_made = False
    try:
        try:
            fd = os.open(os.path.join(store_dir, STORE_LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = os.open(os.path.join(store_dir, STORE_LOCK),
                         os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            lock_made = True
    except (FileNotFoundError, NotADirectoryError):
        return None                   # not a directory (link_current says so)
    except OSError as e:
        raise StagingError(f"{store_dir}: cannot open its lock {STORE_LOCK}: {e.strerror}") from None
    holder = lock_or_holder(fd)
    if holder is not None:
        raise StagingError(f"{store_dir}: in use by pid {holder} (a daemon has this store open, or "
                           f"another stage writes it); close it before staging into it")
    return StoreLock(fd, store_dir, made, lock_made)


def lock_or_holder(fd):
    """Take an exclusive flock on `fd` without waiting and write this pid into its file, so
    that a process refused meanwhile names this one, not the lock's last holder: None. If
    another process holds it, close `fd` and return the pid written there ("?" if none)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return None


def swap_in(work, store_dir, parent, base):
    """Make `work` the store directory in one step; the old generation ends up at `work`."""
    fsync_dir(work)
    if not os.path.exists(store_dir):
        os.rename(work, store_dir)
    elif not _exchange(work, store_dir):
        # no renameat2 here: two renames, a moment without a store directory that
        # remove_leftovers repairs (it restores the retired generation) if we die between them
        retired = os.path.join(parent, f".{base}.retired-{os.getpid()}")
        os.rename(store_dir, retired)
        os.rename(work, store_dir)
        os.rename(retired, work)
    fsync_dir(parent)


def _exchange(a, b):
    """renameat2(a, b, RENAME_EXCHANGE); False where the system or filesystem lacks it."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"exchanging {a} with {b}: {os.strerror(err)}")


class stage_lock:
    """One stager per store directory (flock on a sibling lock file); refuses instead of waiting."""

    def __init__(self, parent, base):
        self.store_dir = os.path.join(parent, base)
        self.path = os.path.join(parent, f".{base}.stage-lock")

    def __enter__(self):
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StagingError(f"{self.store_dir}: cannot open the stage lock {self.path} beside it: "
                               f"{e.strerror or e}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise StagingError(f"{self.store_dir}: another `prefetchd stage` is writing "
                               f"this store (lock {self.path})") from None
        return self

    def __exit__(self, *exc):
        os.close(self.fd)


def remove_leftovers(parent, base):
    """Work directories of stages that died (we hold the lock: no other stage is running)."""
    store_dir = os.path.join(parent, base)
    retired = sorted(glob.glob(os.path.join(parent, f".{glob.escape(base)}.retired-*")))
    if retired and not os.path.exists(store_dir):
        os.rename(retired.pop(), store_dir)       # died between the fallback's two renames
    for leftover in retired + glob.glob(os.path.join(parent, f".{glob.escape(base)}.staging-*")):
        shutil.rmtree(leftover, ignore_errors=True)


def fsync_dir(directory):
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
