"""A `prefetchd serve` worker process (spawn): its own Daemon and control Server,
`spec.models` weight sets of the served model offloaded through it, one batch
at a time from the front's work socket.

Messages on the work socket (a DEALER, identity w<index>-<generation>):
    -> [READY, JSON {index, generation, pid, control, models}]
    <- [job id, JSON batch job, input frames...]
    -> [job id, JSON reply {ok, result|code,reason}, output frames...]
    <- [STOP]
A batch job and its result are prefetchd.serve.execute's. `models` maps each
model to its signature, whether it generates, and its `hints`: the names of its
first parameters (definition order: what its first forward steps read), up to a
quarter of the device budget; the front asks the worker to prefetch them before
it routes a request for that model there.

Each worker's daemon has a store of its own (a FileStore is locked by the
daemon that opens it). With a checkpoint store, the worker's store is made of
hard links to the checkpoint store's tensor files: no data is copied, and that
is safe because a FileStore never writes into an existing file (it writes a new
version and renames it in), so the worker can never change the checkpoint.
"""
import errno
import fcntl
import logging
import os
import shutil
import signal
import threading
import time

import zmq

from ..backend.base import STORE_LOCK
from ..errors import ConfigError
from ..control import protocol as P
from .execute import checks_fit, error_reply, finish_join_checks, run_batch, without_framework_stack
from .servable import ServedModel
from .spec import ServeSpec, build_weight_set, sized, worker_config

log = logging.getLogger("prefetchd.serve.worker")

READY = b"READY"
STOP = b"STOP"
START_FAILED_EXIT = 3

_ready = False
_stopping = False


def first_parameters(cell, max_bytes):
    """Names of `cell`'s parameters in definition order, up to `max_bytes` (at least one)."""
    names, total = [], 0
    for param in cell.get_parameters():
        nbytes = param.size * param.itemsize if hasattr(param, "itemsize") else param.nbytes
        if names and total + nbytes > max_bytes:
            break
        names.append(param.name)
        total += nbytes
    return names


def build_models(spec, daemon, first=None):
    """{name: ServedModel}: one weight set per model name, offloaded through `daemon`
    (`first`: the first one, built already by spec.sized).

    The one place that decides what a worker runs (prefetchd.serve.servable).
    """
    from ..hooks.offload import offload

    models = {}
    for i, name in enumerate(spec.model_names()):
        servable = first if i == 0 and first is not None else build_weight_set(spec, spec.seed + i)
        cell = servable.cell
        if not spec.checkpoint_store:    # the store's names are the checkpoint's: keep them
            cell.update_parameters_name(f"{name}.")
        hints = first_parameters(cell, spec.device_budget() // 4)
        # auto_fetch: another model may have evicted this one's next units; a server
        # fetches them on demand (a stall) rather than failing the request.
        handle = offload(cell, daemon, lookahead=spec.lookahead, tier=spec.tier, auto_fetch=True,
                         checkpoint=True if spec.checkpoint_store else None)
        models[name] = ServedModel(name, servable, handle, hints)
    return models


def link_checkpoint_store(src, dst, generation=None):
    """Make `dst` (new) a store holding the tensors of the store `src`: a hard link per
    tensor file (*.pfd). ConfigError if it cannot, saying why, or if `src` holds another
    generation than `generation` (where given: what the server started with; a worker
    respawned after a new `prefetchd stage` would serve other weights than the others)."""
    from ..staging import read_index
    before = read_index(src).get("generation")
    if generation is not None and before != generation:
        raise ConfigError(f"checkpoint store {src}: `prefetchd stage` replaced it since the server started "
                          f"(generation {before}, the server serves {generation}); a worker started now would "
                          f"serve other weights than the others: restart the server to serve the new one")
    os.mkdir(dst, 0o700)
    vanished = False
    try:
        for entry in os.scandir(src):
            if entry.name.endswith(".pfd") and entry.is_file(follow_symlinks=False):
                os.link(entry.path, os.path.join(dst, entry.name), follow_symlinks=False)
    except FileNotFoundError:
        vanished = True          # a file went away mid-scan: a stage retired this generation
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise ConfigError(f"worker store {dst}: cannot hard-link the checkpoint store {src} "
                              f"(another filesystem); put --store on its filesystem") from None
        raise ConfigError(f"worker store {dst}: linking the checkpoint store {src} failed: "
                          f"{e.strerror}") from None
    if vanished or read_index(src).get("generation") != before:
        raise ConfigError(f"checkpoint store {src}: a `prefetchd stage` replaced it while worker "
                          f"store {dst} was linked to it; restart the server")


def worker_store_path(spec, index, generation):
    return os.path.join(spec.store_dir, f"worker-{index}-{generation}")


def store_in_use(store):
    """Whether a live process holds `store`'s FileStore lock: a worker of a front killed with
    SIGKILL still finishing its job, whose store a new front's worker of the same index and
    generation must neither take nor remove."""
    try:
        fd = os.open(os.path.join(store, STORE_LOCK), os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)          # (and with it the probe's shared lock)


def worker_store(spec, index, generation):
    """The store directory of worker `index`'s daemon (see the module docstring)."""
    store = worker_store_path(spec, index, generation)
    if not spec.checkpoint_store:
        os.makedirs(store, exist_ok=True)
        return store
    # Left by an earlier run under the same --store: derived from the checkpoint only,
    # and it must hold exactly what the checkpoint holds now.
    shutil.rmtree(store, ignore_errors=True)
    os.makedirs(spec.store_dir, exist_ok=True)
    link_checkpoint_store(spec.checkpoint_store, store, spec.checkpoint_generation)
    return store


def remove_worker_store(spec, index, generation):
    """Remove the store of a worker that has exited (its files are derived: the
    weights it wrote, or links to the checkpoint store, which stays as it is)."""
    if spec.store_dir:
        store = worker_store_path(spec, index, generation)
        if not store_in_use(store):        # (a start refused "in use": another process's store)
            shutil.rmtree(store, ignore_errors=True)


def _exit_on_sigterm(signum, frame):
    if _stopping:
        return                # already closing the daemon: let it finish (its close is bounded)
    if not _ready:
        os._exit(0)           # mid-import or mid-build: nothing worth saving, and unwinding
                              # through MindSpore's initialisation aborts noisily
    raise SystemExit(0)       # unwinds through the finally that closes the daemon


def _received(frames):
    """(frames, the job's header parsed or the error parsing it raised); None for a STOP or a
    message too short to be a job (ignored)."""
    if frames[0].bytes == STOP:
        return frames, None
    if len(frames) < 2:
        return None
    try:
        return frames, P.loads(frames[1].bytes)
    except Exception as e:       # noqa: BLE001 - _run answers that job with the error
        return frames, e


def _run(models, job_id, job, frames, index, max_bytes):
    """The reply frames of one job (see prefetchd.serve.execute)."""
    try:
        if isinstance(job, Exception):
            raise job
        result, out = run_batch(models[job["model"]], job, frames, max_bytes, worker=index)
        result.update(worker=index, pid=os.getpid())
        return [job_id, P.dumps({"ok": True, "result": result}), *out]
    except Exception as e:  # noqa: BLE001 - the front answers the client
        return [job_id, P.dumps({"ok": False, **error_reply(e, index)})]


def _parts(job):
    """The parts of a parsed job ([] for a STOP, a job that did not parse, or one without)."""
    parts = job.get("parts") if isinstance(job, dict) else None
    return [p for p in parts if isinstance(p, dict)] if isinstance(parts, list) else []


def _exit_if_orphaned(parent_pid):
    """Watch for the front's death (SIGKILL) from a thread: the work loop looks only between
    jobs, and a long generate would run on for nobody, holding its store."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    if not _ready:
        os._exit(0)                  # nothing built is worth saving, nobody to answer
    log.warning("worker: the front is gone; exiting")
    os.kill(os.getpid(), signal.SIGTERM)     # the job unwinds, the daemon closes (_exit_on_sigterm)


def worker_main(index, generation, spec_dict, work_endpoint, control_endpoint, parent_pid, failure):
    """Entry point of a worker process (spawn). failure: the write end of a pipe that takes
    the one line saying why it could not start, if it cannot (it then exits 3)."""
    global _ready, _stopping
    import faulthandler
    faulthandler.enable()        # a native crash leaves Python tracebacks in the worker's stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the front decides when we stop
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # ...and says so with SIGTERM
    spec = ServeSpec(**spec_dict)
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(asctime)s worker-{index} %(name)s %(levelname)s %(message)s")
    from ..daemon import Daemon

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.identity = f"w{index}-{generation}".encode()
    sock.connect(work_endpoint)
    daemon, models = None, {}
    # A front that dies (SIGKILL) while the model builds (the work loop below not running yet)
    # or while a job runs would leave this process behind, for ever if the factory blocks.
    threading.Thread(target=_exit_if_orphaned, args=(parent_pid,), name="prefetchd-worker-orphan",
                     daemon=True).start()
    try:
        try:
            store = worker_store(spec, index, generation)
            spec, first = sized(spec)
            daemon = Daemon(worker_config(spec, index, store)).start()
            daemon.serve(control_endpoint)
            models = build_models(spec, daemon, first)
        except BaseException as e:  # noqa: BLE001 - said once, by the front, in one line (sys.exit too)
            log.debug("worker %d could not start", index, exc_info=True)
            failure.send(f"{type(e).__name__}: {without_framework_stack(str(e))}")
            raise SystemExit(START_FAILED_EXIT) from None
        sock.send_multipart([READY, P.dumps({
            "index": index, "generation": generation, "pid": os.getpid(),
            "control": control_endpoint,
            "models": {name: m.describe() for name, m in models.items()}})])
        _ready = True
        held = None                  # the next job, received while deciding on the join checks
        while True:
            if held is None:
                if not sock.poll(250):
                    finish_join_checks(models.values())     # idle: the checks put off run now
                    if os.getppid() != parent_pid:
                        log.warning("worker %d: the front is gone; exiting", index)
                        return
                    continue
                held = _received(sock.recv_multipart(copy=False))
            if held is None:
                continue
            (frames, job), held = held, None
            if job is None:
                return                # a STOP
            began = time.monotonic()
            sock.send_multipart(_run(models, frames[0].bytes, job, frames[2:], index,
                                     spec.max_tensor_bytes), copy=False)
            # After the reply (nobody waits on them), unless the next job would miss a deadline.
            per_forward = (time.monotonic() - began) / max(1, len(_parts(job)))
            held = _received(sock.recv_multipart(copy=False)) if sock.poll(0) else None
            if held is None or (held[1] is not None and checks_fit(_parts(held[1]), per_forward, time.monotonic())):
                finish_join_checks(models.values())
    finally:
        _stopping = True
        for model in models.values():
            model.handle.close()
        if daemon is not None:
            daemon.close(5)
        sock.close()
        ctx.term()
