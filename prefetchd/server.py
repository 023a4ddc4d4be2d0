"""`prefetchd serve`: a multi-process inference server with prefetch hints.

    front (this process)                       worker k (spawned process)
    ROUTER  <- clients: infer/status/ping      DEALER -> front work socket
    ROUTER  -> workers: jobs (work socket)     Daemon + its control Server (ipc)
    DEALER  -> each worker's control Server    the demo models, offloaded

Each worker builds `spec.models` weight sets of the demo model
(prefetchd.model.build_model, named m0, m1, ...), streams them through its own
in-process Daemon with prefetchd.hooks.offload, and serves one request at a time.
A device budget smaller than all the weight sets means switching to another
model has to load its weights. The front knows which model a queued request
needs, so when it routes a request to a worker whose last model is a different
one it sends that worker a prefetch hint for the first units of the model over
the worker's control endpoint; the load then overlaps the request ahead of it.

The front never blocks on a worker: it watches every worker's process sentinel
in the same poll as its sockets, so a worker that dies fails its in-flight
requests at once (INTERNAL, "worker ... died") and is respawned; a request that
outlives `request_timeout` is answered TIMEOUT. Workers are started with the
spawn method and exit when the front goes away.

Request (PFD1 frames, see prefetchd.protocol), op "infer":
    {"model": "m1", "seed": 0, "hint": true}
Reply result:
    {"model", "worker", "pid", "checksum", "compute_seconds", "queue_seconds",
     "seconds", "hinted"}
"""
import collections
import dataclasses
import heapq
import itertools
import logging
import math
import multiprocessing
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field

import zmq

from . import protocol as P
from .service import _bind_ipc, ensure_private_dir, resolve_endpoint, runtime_dir, stop_io_thread

log = logging.getLogger("prefetchd.server")

READY = b"READY"
STOP = b"STOP"
MAX_DELAY = 60.0


@dataclass
class ServeSpec:
    """What each worker builds. Plain values: it crosses the spawn boundary."""

    models: int = 2            # weight sets m0..m{models-1}
    hidden: int = 256
    layers: int = 4
    heads: int | None = None
    batch: int = 4
    seq: int = 16
    budget: float | None = None  # device budget of a worker in units of one model's bytes;
                                 # None: the configured device_budget, else 1.5 models
    lookahead: int = 2         # units the hooks prefetch ahead; also units a hint covers
    tier: str = "remote"
    store_dir: str | None = None  # root; worker k uses <root>/worker-<k>-<generation>
    seed: int = 0
    log_level: str = "WARNING"
    config_path: str | None = None  # prefetchd TOML file for the workers' daemons

    def model_names(self):
        return [f"m{i}" for i in range(self.models)]

    def model_bytes(self):
        from .model import estimate_bytes
        return estimate_bytes(self.hidden, self.layers)

    def device_budget(self):
        # At least lookahead + 2 blocks, so a forward pass can always make progress.
        from .model import block_params
        floor = (self.lookahead + 2) * block_params(self.hidden) * 4
        return max(int(self.model_bytes() * (1.5 if self.budget is None else self.budget)), floor)

    def hint_patterns(self, model):
        """Globs naming the first `lookahead` units of `model` (what its first forward needs)."""
        units = min(max(self.lookahead, 1), self.layers)
        return [f"{model}.blocks.{i}.*" for i in range(units)]


# ----------------------------------------------------------------------------- worker

def _configured(path, key):
    """Whether `key` is set by the config file or the environment (not just defaulted)."""
    from .config import ENV_PREFIX
    if ENV_PREFIX + key.upper() in os.environ:
        return True
    path = path or os.environ.get(ENV_PREFIX + "CONFIG")
    if not path:
        return False
    import tomllib
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return False                  # Config.load reports it properly
    return key in doc.get("prefetchd", doc)


def worker_config(spec, index, store):
    """The Config of worker `index`'s daemon: the prefetchd config (file, env) with a
    store of its own, LRU (several models share one daemon, so no single trace
    describes its future), and no endpoint or metrics port of its own: the front
    owns the public endpoint and exports the workers' metrics."""
    from .config import Config
    overrides = {"store_dir": store, "name": f"worker-{index}", "policy": "lru"}
    if spec.budget is not None or not _configured(spec.config_path, "device_budget"):
        overrides["device_budget"] = spec.device_budget()
    return Config.load(spec.config_path, **overrides).replace(endpoint=None, metrics_port=None)


def build_models(spec, daemon):
    """{name: (model, offload handle)}: the demo model once per weight set, offloaded.

    The one place that decides what a worker runs; everything else treats a model
    as `model(inputs) -> tensor`.
    """
    from .hooks import offload
    from .model import build_model

    models = {}
    for i, name in enumerate(spec.model_names()):
        model = build_model(hidden=spec.hidden, layers=spec.layers, heads=spec.heads,
                            seed=spec.seed + i)
        model.update_parameters_name(f"{name}.")
        # auto_fetch: another model may have evicted this one's next units; a server
        # fetches them on demand (a stall) rather than failing the request.
        models[name] = (model, offload(model, daemon, lookahead=spec.lookahead, tier=spec.tier,
                                       auto_fetch=True))
    return models


_ready = False
_stopping = False


def _exit_on_sigterm(signum, frame):
    if _stopping:
        return                # already closing the daemon: let it finish (its close is bounded)
    if not _ready:
        os._exit(0)           # mid-import or mid-build: nothing worth saving, and unwinding
                              # through MindSpore's initialisation aborts noisily
    raise SystemExit(0)       # unwinds through the finally that closes the daemon


def _worker_main(index, generation, spec_dict, work_endpoint, control_endpoint, parent_pid):
    """Entry point of a worker process (spawn)."""
    global _ready, _stopping
    import faulthandler
    faulthandler.enable()        # a native crash leaves Python tracebacks in the worker's stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the front decides when we stop
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # ...and says so with SIGTERM
    spec = ServeSpec(**spec_dict)
    logging.basicConfig(level=spec.log_level.upper(),
                        format=f"%(asctime)s worker-{index} %(name)s %(levelname)s %(message)s")
    import numpy as np

    from .daemon import Daemon
    from .model import make_inputs

    store = os.path.join(spec.store_dir, f"worker-{index}-{generation}")
    os.makedirs(store, exist_ok=True)
    daemon = Daemon(worker_config(spec, index, store)).start()
    ctx = zmq.Context()
    models = {}
    try:
        daemon.serve(control_endpoint)
        models = build_models(spec, daemon)
        inputs = {}
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.identity = f"w{index}-{generation}".encode()
        sock.connect(work_endpoint)
        sock.send_multipart([READY, P.dumps({"index": index, "generation": generation,
                                             "pid": os.getpid(), "control": control_endpoint,
                                             "models": sorted(models)})])
        _ready = True
        while True:
            if not sock.poll(250):
                if os.getppid() != parent_pid:
                    log.warning("worker %d: the front is gone; exiting", index)
                    return
                continue
            frames = sock.recv_multipart()
            if frames[0] == STOP:
                return
            job_id, body = frames
            job = P.loads(body)
            started = time.perf_counter()
            try:
                if job.get("delay"):
                    time.sleep(min(float(job["delay"]), MAX_DELAY))
                model = models[job["model"]][0]
                seed = int(job.get("seed", 0))
                if seed not in inputs:
                    inputs[seed] = make_inputs(spec.batch, spec.seq, spec.hidden, seed=seed + 1)
                out = model(inputs[seed]).asnumpy()
                reply = {"ok": True, "result": {
                    "model": job["model"], "worker": index, "pid": os.getpid(),
                    "checksum": float(np.float64(out.astype(np.float64).sum())),
                    "compute_seconds": time.perf_counter() - started}}
            except Exception as e:  # noqa: BLE001 - the front answers the client
                log.exception("worker %d: request failed", index)
                reply = {"ok": False, "code": P.INTERNAL, "reason": f"worker {index}: {e}"}
            sock.send_multipart([job_id, P.dumps(reply)])
    finally:
        _stopping = True
        for _, handle in models.values():
            handle.close()
        daemon.close(5)
        ctx.destroy(linger=0)


# ----------------------------------------------------------------------------- front

@dataclass
class _Job:
    envelope: list
    rid: bytes
    model: str
    body: dict
    hint: bool
    deadline: float
    received: float
    worker: object = None
    job_id: bytes = b""
    hinted: bool = False


@dataclass
class _Worker:
    index: int
    control: str
    generation: int = 0
    process: object = None
    identity: bytes = b""
    ctl: object = None             # DEALER to the worker's control Server
    ready: bool = False
    pid: int | None = None
    inflight: dict = field(default_factory=dict)
    last_model: str | None = None
    served: int = 0
    failed: int = 0
    deaths: int = 0
    start_failures: int = 0        # deaths before READY, in a row
    spawned_at: float = 0.0


@dataclass
class _Gather:
    envelope: list
    rid: bytes
    deadline: float
    waiting: set
    results: dict = field(default_factory=dict)


class Front:
    """The front process' router. `start()` spawns the workers and waits until
    they are ready; `close()` stops everything within its timeout."""

    def __init__(self, endpoint=None, *, workers=2, spec=None, hints=True, request_timeout=30.0,
                 start_timeout=180.0, respawn=True, max_queue=1024, max_inflight_per_worker=4,
                 max_message_size=P.DEFAULT_MAX_MESSAGE_SIZE, name="serve", metrics_port=None,
                 metrics_addr="127.0.0.1"):
        self.spec = spec or ServeSpec()
        self.name = name
        self.endpoint = resolve_endpoint(endpoint or f"ipc://{name}.sock", name, bind=True)
        self.n_workers = workers
        self.hints = hints
        self.request_timeout = request_timeout
        self.start_timeout = start_timeout
        self.respawn = respawn
        self.max_queue = max_queue
        self.max_inflight = max_inflight_per_worker
        self.max_message_size = max_message_size
        self.counters = collections.Counter()
        self.metrics_port, self.metrics_addr = metrics_port, metrics_addr
        self._exporter = None
        if self.spec.store_dir is None:
            from .config import Config
            configured = Config.load(self.spec.config_path).store_dir
            if configured:
                self.spec = dataclasses.replace(self.spec, store_dir=configured)
        self._owns_store = self.spec.store_dir is None    # a temporary one, made by start()
        tag = f"{os.getpid()}-{secrets.token_hex(2)}"
        base = runtime_dir()
        self._work_endpoint = f"ipc://{os.path.join(base, f'{name}-{tag}-work.sock')}"
        self._workers = [_Worker(i, f"ipc://{os.path.join(base, f'{name}-{tag}-w{i}.sock')}")
                         for i in range(workers)]
        self._mp = multiprocessing.get_context("spawn")
        self._ctx = None
        self._thread = None
        self._started = threading.Event()
        self._start_error = None
        self._stop = False
        self._ctl_address = f"inproc://prefetchd-front-{id(self):x}"
        self._wake_lock = threading.Lock()
        self._wake = None
        self._queue = collections.deque()
        self._timers = []
        self._job_ids = itertools.count(1)
        self._ctl_ids = itertools.count(1)
        self._ctl_waiting = {}         # control rid -> ("hint", worker) | ("status", gather, worker)
        self._gathers = []
        self._ready_event = threading.Event()
        self._closed = False
        self._ipc_files = []

    # -- lifecycle

    def start(self, wait_ready=True):
        if self._thread is not None:
            return self
        ensure_private_dir(runtime_dir())
        if self._owns_store:
            self.spec = dataclasses.replace(self.spec,
                                            store_dir=tempfile.mkdtemp(prefix="prefetchd-serve-"))
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name=f"prefetchd-front-{self.name}",
                                        daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._start_error is not None:
            self._thread.join(5)
            self._ctx.destroy(linger=0)
            if self._owns_store:
                shutil.rmtree(self.spec.store_dir, ignore_errors=True)
            raise self._start_error
        wake = self._ctx.socket(zmq.PUSH)
        wake.linger = 0
        wake.connect(self._ctl_address)
        with self._wake_lock:
            self._wake = wake
        if wait_ready and not self._ready_event.wait(self.start_timeout):
            self.close(10)
            raise TimeoutError(f"prefetchd serve: workers not ready within {self.start_timeout:g}s")
        if self._start_error is not None:
            self.close(10)
            raise self._start_error
        if self.metrics_port is not None:
            self._exporter = start_front_exporter(self, self.metrics_addr, self.metrics_port)
            self.metrics_port = self._exporter.port
        log.info("prefetchd serve: %d workers ready; front on %s", self.n_workers, self.endpoint)
        return self

    def close(self, timeout=10.0):
        if self._closed or self._thread is None:
            self._closed = True
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        if self._exporter is not None:
            self._exporter.close(1.0)
        self._stop = True
        stop_io_thread(self, "_wake", STOP, self._thread, deadline)
        procs = [w.process for w in self._workers if w.process is not None]
        grace = time.monotonic() + min(3.0, max(0.0, deadline - time.monotonic()) / 2)
        for p in procs:                    # they got STOP; give them a moment to close
            p.join(max(0.0, grace - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()              # SIGTERM: the worker closes its daemon and exits
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)
        if self._owns_store:
            shutil.rmtree(self.spec.store_dir, ignore_errors=True)

    def serve_forever(self):
        """Run until SIGINT/SIGTERM (for the CLI)."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.start()
        try:
            while not stop.wait(0.5) and self._thread.is_alive():
                pass
        finally:
            self.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def workers(self):
        """[(index, pid, ready)] — a snapshot for tests and the CLI."""
        return [(w.index, w.pid, w.ready) for w in self._workers]

    # -- I/O thread

    def _run(self):
        try:
            self._setup()
        except BaseException as e:  # noqa: BLE001 - handed to start()
            self._start_error = e
            self._close_sockets()
            self._started.set()
            return
        self._started.set()
        try:
            self._loop()
        except Exception:  # noqa: BLE001
            log.exception("prefetchd serve: front loop crashed")
        finally:
            self._teardown()

    def _socket(self, kind):
        sock = self._ctx.socket(kind)
        sock.linger = 0
        sock.sndhwm = sock.rcvhwm = 1000
        return sock

    def _bind(self, sock, address):
        _bind_ipc(sock, address) if address.startswith("ipc://") else sock.bind(address)
        if address.startswith("ipc://"):
            self._ipc_files.append(address[len("ipc://"):])

    def _setup(self):
        self._ctl = self._socket(zmq.PULL)
        self._ctl.bind(self._ctl_address)
        self._router = self._socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.maxmsgsize = 4 * self.max_message_size + 64
        self._bind(self._router, self.endpoint)
        self.endpoint = self._router.last_endpoint.decode()
        self._work = self._socket(zmq.ROUTER)
        self._work.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._bind(self._work, self._work_endpoint)
        for w in self._workers:
            self._spawn(w)

    def _spawn(self, w):
        w.generation += 1
        w.ready, w.pid, w.last_model = False, None, None
        w.identity = f"w{w.index}-{w.generation}".encode()
        w.process = self._mp.Process(
            target=_worker_main, name=f"prefetchd-worker-{w.index}", daemon=True,
            args=(w.index, w.generation, dataclasses.asdict(self.spec), self._work_endpoint,
                  w.control, os.getpid()))
        w.process.start()
        w.spawned_at = time.monotonic()
        if w.ctl is not None:
            w.ctl.close(linger=0)
        w.ctl = self._socket(zmq.DEALER)
        w.ctl.connect(w.control)

    def _loop(self):
        while not self._stop:
            poller = zmq.Poller()          # rebuilt: sentinels and control sockets change
            poller.register(self._ctl, zmq.POLLIN)
            poller.register(self._router, zmq.POLLIN)
            poller.register(self._work, zmq.POLLIN)
            sentinels = {}
            for w in self._workers:
                poller.register(w.ctl, zmq.POLLIN)
                if w.process is not None:
                    sentinels[w.process.sentinel] = w
                    poller.register(w.process.sentinel, zmq.POLLIN)
            ready = dict(poller.poll(self._timeout_ms()))
            if ready.pop(self._ctl, 0):
                if self._drain_control():
                    return
            for fd, w in sentinels.items():
                if ready.get(fd):
                    self._on_death(w)
            if ready.get(self._work):
                self._drain(self._work, self._on_worker_message)
            for w in self._workers:
                if ready.get(w.ctl):
                    self._drain(w.ctl, lambda frames, w=w: self._on_control_reply(w, frames))
            if ready.get(self._router):
                self._drain(self._router, self._on_request)
            self._dispatch()
            self._run_timers()

    def _drain(self, sock, handle):
        for _ in range(256):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handle(frames)
            except Exception:  # noqa: BLE001 - one bad message must not stop the front
                log.exception("prefetchd serve: handling a message failed")

    def _drain_control(self):
        while True:
            try:
                if self._ctl.recv(zmq.NOBLOCK) == STOP:
                    return True
            except zmq.Again:
                return False

    def _timeout_ms(self):
        nearest = min([t[0] for t in self._timers[:1]] + [g.deadline for g in self._gathers],
                      default=None)
        if nearest is None:
            return 500
        return max(0, min(500, math.ceil((nearest - time.monotonic()) * 1000)))

    def _teardown(self):
        for job in list(self._queue):
            self._reply_error(job, P.SHUTDOWN, "server closing")
        self._queue.clear()
        for w in self._workers:
            for job in list(w.inflight.values()):
                self._reply_error(job, P.SHUTDOWN, "server closing")
            w.inflight.clear()
            if w.ready:
                try:
                    self._work.send_multipart([w.identity, STOP], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self._close_sockets()

    def _close_sockets(self):
        for sock in [getattr(self, "_router", None), getattr(self, "_work", None),
                     getattr(self, "_ctl", None)] + [w.ctl for w in self._workers]:
            if sock is not None:
                sock.close(linger=0)
        for w in self._workers:
            w.ctl = None
        for path in self._ipc_files:
            try:
                os.unlink(path)
            except OSError:
                pass

    # -- replies

    def _send(self, envelope, frames):
        try:
            self._router.send_multipart(envelope + frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters["replies_dropped"] += 1

    def _reply_error(self, job, code, reason):
        self.counters["errors"] += 1
        self.counters["error:" + code] += 1
        self._send(job.envelope, P.encode_error(job.rid, code, reason))

    # -- clients

    def _on_request(self, frames):
        envelope, payload = P.split_envelope(frames)
        try:
            rid, op, args, timeout = P.decode_request(payload, self.max_message_size)
        except P.ProtocolError as e:
            self.counters["malformed"] += 1
            self._send(envelope, P.encode_error(e.rid, e.code, e.reason))
            return
        now = time.monotonic()
        if op == "ping":
            self._send(envelope, P.encode_ok(rid, {
                "pong": True, "protocol": P.MAGIC.decode(), "pid": os.getpid(),
                "workers": sum(w.ready for w in self._workers), "models": self.spec.model_names()}))
        elif op == "status":
            self._start_status(envelope, rid, now)
        elif op == "infer":
            model = args.get("model")
            if model not in self.spec.model_names():
                self._send(envelope, P.encode_error(rid, P.BAD_REQUEST,
                                                    f"infer: unknown model {str(model)[:64]!r}; "
                                                    f"models: {', '.join(self.spec.model_names())}"))
                return
            seed, hint, delay = args.get("seed", 0), args.get("hint", self.hints), args.get("delay", 0)
            if (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2 ** 31
                    or not isinstance(hint, bool) or not isinstance(delay, (int, float))
                    or isinstance(delay, bool) or not 0 <= delay <= MAX_DELAY):
                self._send(envelope, P.encode_error(rid, P.BAD_REQUEST,
                                                    "infer: seed must be an int >= 0, hint a bool, "
                                                    f"delay 0..{MAX_DELAY:g} seconds"))
                return
            if len(self._queue) >= self.max_queue:
                self.counters["busy"] += 1
                self._send(envelope, P.encode_error(rid, P.BUSY,
                                                    f"{len(self._queue)} requests queued"))
                return
            wait = min(timeout or self.request_timeout, self.request_timeout)
            job = _Job(envelope, rid, model, {"model": model, "seed": seed, "delay": delay},
                       hint, now + wait, now)
            self._queue.append(job)
            heapq.heappush(self._timers, (job.deadline, next(self._job_ids), job))
            self.counters["requests"] += 1
        else:
            self._send(envelope, P.encode_error(rid, P.BAD_REQUEST,
                                                f"unknown op {op[:64]!r}; known: infer, ping, status"))

    # -- routing

    def _pick(self, model):
        best, best_key = None, None
        for w in self._workers:
            if not w.ready or len(w.inflight) >= self.max_inflight:
                continue
            key = (len(w.inflight), w.last_model != model, w.index)
            if best_key is None or key < best_key:
                best, best_key = w, key
        return best

    def _dispatch(self):
        while self._queue:
            job = self._queue[0]
            w = self._pick(job.model)
            if w is None:
                return
            self._queue.popleft()
            if job.hint and w.last_model != job.model:
                self._hint(w, job.model)
                job.hinted = True
            job.job_id = P.new_rid(next(self._job_ids))
            job.worker = w
            try:
                self._work.send_multipart([w.identity, job.job_id, P.dumps(job.body)], zmq.NOBLOCK)
            except zmq.ZMQError:
                w.ready = False            # its connection is gone; the sentinel will tell why
                self._queue.appendleft(job)
                continue
            w.inflight[job.job_id] = job
            w.last_model = job.model

    def _hint(self, w, model):
        for pattern in self.spec.hint_patterns(model):
            rid = P.new_rid(next(self._ctl_ids))
            try:
                w.ctl.send_multipart(P.encode_request(rid, "prefetch", {
                    "pattern": pattern, "wait": False, "priority": 1}), zmq.NOBLOCK)
            except zmq.ZMQError:
                self.counters["hints_dropped"] += 1
                continue
            self._ctl_waiting[rid] = ("hint", w)
            self.counters["hints_sent"] += 1

    # -- workers

    def _on_worker_message(self, frames):
        if len(frames) != 3:
            return
        identity = frames[0]
        w = next((w for w in self._workers if w.identity == identity), None)
        if w is None:
            return                          # a previous generation; it is exiting
        if frames[1] == READY:
            info = P.loads(frames[2])
            w.ready, w.pid, w.start_failures = True, info["pid"], 0
            log.info("prefetchd serve: worker %d ready (pid %d)", w.index, w.pid)
            if all(x.ready for x in self._workers):
                self._ready_event.set()
            return
        job_id, body = frames[1], frames[2]
        job = w.inflight.pop(job_id, None)
        if job is None:
            return                          # timed out already
        doc = P.loads(body)
        now = time.monotonic()
        if doc.get("ok"):
            w.served += 1
            result = dict(doc["result"], seconds=now - job.received, hinted=job.hinted,
                          queue_seconds=now - job.received - doc["result"]["compute_seconds"])
            self._send(job.envelope, P.encode_ok(job.rid, result))
        else:
            w.failed += 1
            self._reply_error(job, doc.get("code", P.INTERNAL), doc.get("reason", ""))

    def _on_death(self, w):
        w.process.join(1.0)            # the sentinel fires just before the child is reapable
        code = w.process.exitcode
        if not w.ready:
            w.start_failures += 1
        reason = (f"worker {w.index} (pid {w.pid}) died "
                  f"({'signal ' + str(-code) if code is not None and code < 0 else f'exit {code}'})"
                  " while serving the request")
        log.warning("prefetchd serve: %s; %d requests failed", reason.split(" while")[0],
                    len(w.inflight))
        for job in w.inflight.values():
            self._reply_error(job, P.INTERNAL, reason)
        w.inflight.clear()
        w.deaths += 1
        self.counters["worker_deaths"] += 1
        for rid, entry in list(self._ctl_waiting.items()):
            if entry[1] is w:
                self._ctl_waiting.pop(rid)
        for g in self._gathers:
            if w.index in g.waiting:
                g.waiting.discard(w.index)
                g.results[w.index] = {"error": "worker died"}
        if w.start_failures >= 3:
            log.error("prefetchd serve: worker %d failed to start 3 times in a row; giving up "
                      "(see its log above)", w.index)
        if self.respawn and not self._stop and w.start_failures < 3:
            self._spawn(w)
            return
        w.process, w.ready = None, False
        if all(x.process is None for x in self._workers):
            self._start_error = RuntimeError("prefetchd serve: no worker could be started")
            self._ready_event.set()

    # -- status

    def _start_status(self, envelope, rid, now):
        g = _Gather(envelope, rid, now + 2.0, set())
        for w in self._workers:
            if not w.ready:
                continue
            crid = P.new_rid(next(self._ctl_ids))
            try:
                w.ctl.send_multipart(P.encode_request(crid, "status", {}, 1.5), zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            self._ctl_waiting[crid] = ("status", w, g)
            g.waiting.add(w.index)
        self._gathers.append(g)
        self._finish_gathers(now)

    def _on_control_reply(self, w, frames):
        try:
            rid, doc = P.decode_reply(frames)
        except P.ProtocolError:
            return
        entry = self._ctl_waiting.pop(rid, None)
        if entry is None:
            return
        if entry[0] == "hint":
            self.counters["hints_ok" if doc.get("ok") else "hints_failed"] += 1
            return
        g = entry[2]
        g.waiting.discard(w.index)
        g.results[w.index] = doc.get("result") if doc.get("ok") else {"error": doc.get("reason")}
        self._finish_gathers(time.monotonic())

    def _finish_gathers(self, now):
        for g in [g for g in self._gathers if not g.waiting or g.deadline <= now]:
            self._gathers.remove(g)
            for crid, entry in list(self._ctl_waiting.items()):
                if entry[0] == "status" and entry[2] is g:
                    self._ctl_waiting.pop(crid)
            self._send(g.envelope, P.encode_ok(g.rid, self._status(g.results)))

    def _status(self, results):
        workers = []
        total = collections.Counter()
        for w in self._workers:
            daemon = results.get(w.index)
            workers.append({"index": w.index, "pid": w.pid, "ready": w.ready,
                            "generation": w.generation, "control": w.control,
                            "inflight": len(w.inflight), "served": w.served, "failed": w.failed,
                            "deaths": w.deaths, "last_model": w.last_model,
                            "daemon": daemon if daemon is not None else {"error": "no reply"}})
            if daemon and "device" in daemon:
                total["device_used"] += daemon["device"]["used"]
                total["device_capacity"] += daemon["device"]["capacity"]
                total["resident"] += daemon["states"].get("resident", 0)
                total["tensors"] += daemon["tensors"]
        return {"front": {"endpoint": self.endpoint, "pid": os.getpid(), "hints": self.hints,
                          "queued": len(self._queue), "models": self.spec.model_names(),
                          "counters": dict(self.counters)},
                "workers": workers, "total": dict(total)}

    # -- timers

    def _run_timers(self):
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, job = heapq.heappop(self._timers)
            if job.worker is not None:
                if job.worker.inflight.pop(job.job_id, None) is None:
                    continue                # answered
            elif job in self._queue:
                self._queue.remove(job)
            else:
                continue
            self.counters["timeouts"] += 1
            where = f"on worker {job.worker.index}" if job.worker else "waiting for a worker"
            self._reply_error(job, P.TIMEOUT, f"infer did not complete within "
                                              f"{job.deadline - job.received:.3g}s ({where})")
        if self._gathers:
            self._finish_gathers(now)


# ----------------------------------------------------------------------------- metrics

class FrontCollector:
    """Prometheus collector of a front: its own prefetchd_serve_* series plus every
    worker's daemon series, fetched over the workers' control endpoints at scrape
    time (one `stats` request each) and merged; the `daemon` label tells workers
    apart. A worker that does not answer within a second is left out of that
    scrape and shows as prefetchd_serve_worker_up 0."""

    def __init__(self, front, timeout=1.0):
        self._front = front
        self._timeout = timeout
        self._clients = {}
        self._lock = threading.Lock()

    def _client(self, endpoint):
        from .service import Client
        with self._lock:
            if endpoint not in self._clients:
                self._clients[endpoint] = Client(endpoint, timeout=self._timeout)
            return self._clients[endpoint]

    def close(self):
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from .metrics import DaemonCollector
        from .service import stats_from_json

        front = self._front
        counters = dict(front.counters)
        up = GaugeMetricFamily("prefetchd_serve_worker_up",
                               "1 if the worker answered this scrape's stats request.",
                               labels=["worker"])
        merged = {}
        for w in list(front._workers):
            doc = None
            if w.ready:
                try:
                    doc = self._client(w.control).stats()
                except Exception:  # noqa: BLE001 - a scrape reports what it can
                    doc = None
            up.add_metric([str(w.index)], 1 if doc else 0)
            if not doc:
                continue
            for fam in DaemonCollector.families(doc["status"], stats_from_json(doc["stats"])):
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        requests = CounterMetricFamily("prefetchd_serve_requests",
                                       "Inference requests accepted by the front.")
        requests.add_metric([], counters.get("requests", 0))
        errors = CounterMetricFamily("prefetchd_serve_errors",
                                     "Error replies of the front, by code.", labels=["code"])
        for key, n in sorted(counters.items()):
            if key.startswith("error:"):
                errors.add_metric([key[len("error:"):]], n)
        hints = CounterMetricFamily("prefetchd_serve_hints",
                                    "Prefetch hints sent to workers, by outcome.", labels=["outcome"])
        for outcome in ("sent", "ok", "failed", "dropped"):
            hints.add_metric([outcome], counters.get(f"hints_{outcome}", 0))
        deaths = CounterMetricFamily("prefetchd_serve_worker_deaths",
                                     "Worker processes that exited unexpectedly.")
        deaths.add_metric([], counters.get("worker_deaths", 0))
        queue = GaugeMetricFamily("prefetchd_serve_queue_depth",
                                  "Requests waiting in the front for a worker.")
        queue.add_metric([], len(front._queue))
        ready = GaugeMetricFamily("prefetchd_serve_workers_ready", "Workers ready to serve.")
        ready.add_metric([], sum(1 for w in front._workers if w.ready))
        return [requests, errors, hints, deaths, queue, ready, up, *merged.values()]


def start_front_exporter(front, addr="127.0.0.1", port=0):
    """Serve the front's and its workers' metrics on http://addr:port/metrics."""
    from prometheus_client import CollectorRegistry, start_http_server

    from .metrics import Exporter

    collector = FrontCollector(front)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    server, thread = start_http_server(int(port), addr=addr or "127.0.0.1", registry=registry)
    thread.name = f"prefetchd-metrics-{front.name}"
    exporter = Exporter(registry, server, thread)
    close = exporter.close

    def close_all(timeout=5.0):
        close(timeout)
        collector.close()

    exporter.close = close_all
    return exporter


def serve(endpoint=None, **kwargs):
    """Run a Front in the foreground until SIGINT/SIGTERM."""
    Front(endpoint, **kwargs).serve_forever()
