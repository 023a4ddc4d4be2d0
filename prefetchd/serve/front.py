"""`prefetchd serve`'s front: a ROUTER for inference clients that routes requests
to N worker processes (prefetchd.serve.pool) with prefetch hints.

    front (this process)                       worker k (spawned process)
    ROUTER  <- clients: infer/status/ping      DEALER -> front work socket
    ROUTER  -> workers: jobs (work socket)     Daemon + its control Server (ipc)
    DEALER  -> each worker's control Server    the served models, offloaded

A device budget smaller than all the weight sets means switching to another
model has to load its weights. The front knows which model a queued request
needs, so when it routes a request to a worker whose last model is a different
one it first asks that worker's daemon to prefetch the model's first units; the
load then overlaps the request ahead of it.

The front never blocks on a worker: it polls every worker's process sentinel
with its sockets (one prefetchd.control.ioloop.IOLoop thread), so a worker that
dies fails its in-flight requests at once (INTERNAL, "worker ... died") and is
respawned; a request that outlives `request_timeout` is answered TIMEOUT.
The `status` op's fan-out to the workers' daemons is prefetchd.serve.status;
requests and their deadlines are prefetchd.serve.jobs.

Request (PFD1 frames, see prefetchd.control.protocol), op "infer":
    {"model": "m1", "seed": 0, "hint": true}
Reply result:
    {"model", "worker", "pid", "checksum", "compute_seconds", "queue_seconds",
     "seconds", "hinted"}
"""
import collections
import dataclasses
import itertools
import logging
import os
import secrets
import shutil
import signal
import tempfile
import threading
import time

import zmq

from ..control import protocol as P
from ..control.codes import BadArguments
from ..control.endpoints import bind, ensure_private_dir, resolve_endpoint, runtime_dir, unlink_ipc_files
from ..control.ioloop import IOLoop
from ..control.ops import Op, flag, integer, number
from .jobs import Deadlines, Job, model_name
from .pool import WorkerPool
from .spec import ServeSpec, check_checkpoint_store
from .status import StatusGathers, status_document
from .worker import MAX_DELAY, READY, STOP

log = logging.getLogger("prefetchd.serve.front")


class Front:
    """The front process' router. `start()` spawns the workers and waits until
    they are ready; `close()` stops everything within its timeout. Implements
    prefetchd.control.ioloop.LoopHandler (setup/poll_items/tick/poll_timeout/
    teardown/release are for its IOLoop only)."""

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
        self.max_message_size = max_message_size
        self.counters = collections.Counter()
        self.metrics_port, self.metrics_addr = metrics_port, metrics_addr
        self._exporter = None
        if self.spec.store_dir is None:
            from ..config import Config
            configured = Config.load(self.spec.config_path).store_dir
            if configured:
                self.spec = dataclasses.replace(self.spec, store_dir=configured)
        self._owns_store = self.spec.store_dir is None    # a temporary one, made by start()
        if self.spec.checkpoint_store:     # refused here, not by every worker as it starts
            check_checkpoint_store(self.spec, self.spec.store_dir)
        tag = f"{os.getpid()}-{secrets.token_hex(2)}"
        base = runtime_dir()
        self._pool = WorkerPool(
            workers, lambda i: f"ipc://{os.path.join(base, f'{name}-{tag}-w{i}.sock')}",
            f"ipc://{os.path.join(base, f'{name}-{tag}-work.sock')}", self.spec,
            max_inflight_per_worker)
        self._loop = IOLoop(self, f"prefetchd-front-{name}", max_poll=0.5)
        self._ops = {"ping": Op(self._op_ping), "status": Op(self._op_status),
                     "infer": Op(self._op_infer, {
                         "model": (model_name, None), "seed": (integer(0, 2 ** 31 - 1), 0),
                         "hint": (flag, None), "delay": (number(0, MAX_DELAY), 0)})}
        self._router = self._work = None
        self._queue = collections.deque()
        self._deadlines = Deadlines()
        self._job_ids = itertools.count(1)
        self._ctl_ids = itertools.count(1)
        self._hints_waiting = {}       # control rid -> slot, for hints
        self._status = StatusGathers(self._send, lambda: P.new_rid(next(self._ctl_ids)))
        self._ready_event = threading.Event()
        self._start_error = None
        self._closed = False
        self._ipc_files = []
        self._shared = None           # (owner, its store) of the shared host tier, with --shared-host
        self._tag = f"{name}-{tag}"

    # -- lifecycle

    def start(self, wait_ready=True):
        if self._loop.running:
            return self
        ensure_private_dir(runtime_dir())
        if self._owns_store:
            # Beside a checkpoint store: worker stores hard-link its files, so same filesystem.
            near = (os.path.dirname(os.path.realpath(self.spec.checkpoint_store))
                    if self.spec.checkpoint_store else None)
            self.spec = dataclasses.replace(self.spec, store_dir=tempfile.mkdtemp(
                prefix=".prefetchd-serve-" if near else "prefetchd-serve-", dir=near))
            self._pool.spec = self.spec
        try:
            if self.spec.shared_host:
                from ..sharedhost.serving import start_owner
                from .worker import link_checkpoint_store
                self._shared = start_owner(self.spec, runtime_dir(), self._tag, link_checkpoint_store)
                self.spec = self._pool.spec = dataclasses.replace(self.spec, shared_socket=self._shared[0].path)
            self._loop.start(30)
        except BaseException:
            self._stop_shared()
            if self._owns_store:
                shutil.rmtree(self.spec.store_dir, ignore_errors=True)
            raise
        if wait_ready and not self._ready_event.wait(self.start_timeout):
            self.close(10)
            raise TimeoutError(f"prefetchd serve: workers not ready within {self.start_timeout:g}s")
        if self._start_error is not None:
            self.close(10)
            raise self._start_error
        if self.metrics_port is not None:
            from .metrics import start_front_exporter
            self._exporter = start_front_exporter(self, self.metrics_addr, self.metrics_port)
            self.metrics_port = self._exporter.port
        log.info("prefetchd serve: %d workers ready; front on %s", self.n_workers, self.endpoint)
        return self

    def close(self, timeout=10.0):
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        if self._exporter is not None:
            self._exporter.close(1.0)
        self._loop.close(max(0.0, deadline - time.monotonic()))
        self._pool.stop(deadline)
        self._stop_shared()
        if self._owns_store:
            shutil.rmtree(self.spec.store_dir, ignore_errors=True)

    def _stop_shared(self):
        if self._shared is not None:
            from ..sharedhost.serving import stop_owner
            stop_owner(*self._shared)
            self._shared = None

    def shared_status(self):
        """The shared host tier's status (prefetchd.sharedhost), or None without one."""
        return self._shared[0].status() if self._shared is not None else None

    def serve_forever(self):
        """Run until SIGINT/SIGTERM (for the CLI)."""
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.start()
        try:
            while not stop.wait(0.5) and self._loop.running:
                pass
        finally:
            self.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def workers(self):
        """[(index, pid, ready)] — a snapshot for tests and the CLI."""
        return [(s.index, s.pid, s.ready) for s in self._pool.slots]

    def snapshot(self):
        """What the front's metrics report: counters, queue depth and each worker's
        public state (safe to call from another thread: copies only)."""
        return {"counters": dict(self.counters), "queued": len(self._queue),
                "workers": [s.public() for s in list(self._pool.slots)],
                "shared_host": self.shared_status()}

    @property
    def socket_files(self):
        """The ipc socket files the front bound (removed by close())."""
        return [self.endpoint[len("ipc://"):], self._pool.work_endpoint[len("ipc://"):]]

    @property
    def running(self):
        return self._loop.running

    # -- LoopHandler (I/O thread)

    def setup(self, ctx):
        self._router = self._socket(ctx, zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._router.maxmsgsize = 4 * self.max_message_size + 64
        self._bind(self._router, self.endpoint)
        self.endpoint = self._router.last_endpoint.decode()
        self._work = self._socket(ctx, zmq.ROUTER)
        self._work.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._bind(self._work, self._pool.work_endpoint)
        self._pool.start(ctx)

    def poll_items(self):
        items = [(self._router, self._on_request), (self._work, self._on_worker_message)]
        for s in self._pool.slots:
            if s.ctl is not None:
                items.append((s.ctl, lambda frames, s=s: self._on_control_reply(s, frames)))
            if s.process is not None:
                items.append((s.process.sentinel, lambda s=s: self._on_death(s)))
        return items

    def tick(self):
        self._dispatch()
        self._run_timers()

    def poll_timeout(self):
        nearest = min((t for t in (self._deadlines.nearest(), self._status.nearest_deadline())
                       if t is not None), default=None)
        return None if nearest is None else nearest - time.monotonic()

    def teardown(self):
        for job in list(self._queue):
            self._reply_error(job, P.SHUTDOWN, "server closing")
        self._queue.clear()
        for s in self._pool.slots:
            for job in list(s.inflight.values()):
                self._reply_error(job, P.SHUTDOWN, "server closing")
            s.inflight.clear()
            if s.ready and self._work is not None:
                try:
                    self._work.send_multipart([s.identity, STOP], zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for sock in (self._router, self._work):
            if sock is not None:
                sock.close(linger=0)
        self._router = self._work = None
        self._pool.close_sockets()
        unlink_ipc_files(self._ipc_files)
        self._ipc_files.clear()

    def release(self):
        pass

    @staticmethod
    def _socket(ctx, kind):
        sock = ctx.socket(kind)
        sock.linger = 0
        sock.sndhwm = sock.rcvhwm = 1000
        return sock

    def _bind(self, sock, address):
        ipc_file = bind(sock, address)
        if ipc_file is not None:
            self._ipc_files.append(ipc_file)

    # -- replies

    def _send(self, envelope, frames):
        try:
            self._router.send_multipart(envelope + frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters["replies_dropped"] += 1

    def _error(self, envelope, rid, code, reason):
        self.counters["errors"] += 1
        self.counters["error:" + code] += 1
        self._send(envelope, P.encode_error(rid, code, reason))

    def _reply_error(self, job, code, reason):
        self._error(job.envelope, job.rid, code, reason)

    # -- clients: the op table

    def _on_request(self, frames):
        envelope, payload = P.split_envelope(frames)
        try:
            rid, op, args, timeout = P.decode_request(payload, self.max_message_size)
        except P.ProtocolError as e:
            self.counters["malformed"] += 1
            self._send(envelope, P.encode_error(e.rid, e.code, e.reason))
            return
        spec = self._ops.get(op)
        if spec is None:
            self._error(envelope, rid, P.BAD_REQUEST,
                        f"unknown op {op[:64]!r}; known: {', '.join(sorted(self._ops))}")
            return
        try:
            spec.handler(envelope, rid, spec.validate(args), timeout)
        except BadArguments as e:
            self._error(envelope, rid, P.BAD_REQUEST, f"{op}: {e}")

    def _op_ping(self, envelope, rid, args, timeout):
        self._send(envelope, P.encode_ok(rid, {
            "pong": True, "protocol": P.MAGIC.decode(), "pid": os.getpid(),
            "workers": sum(s.ready for s in self._pool.slots), "models": self.spec.model_names()}))

    def _op_infer(self, envelope, rid, args, timeout):
        model = args["model"]
        if model not in self.spec.model_names():
            raise BadArguments(f"unknown model {str(model)[:64]!r}; "
                               f"models: {', '.join(self.spec.model_names())}")
        if len(self._queue) >= self.max_queue:
            self.counters["busy"] += 1
            self._error(envelope, rid, P.BUSY, f"{len(self._queue)} requests queued")
            return
        now = time.monotonic()
        wait = min(timeout or self.request_timeout, self.request_timeout)
        hint = self.hints if args["hint"] is None else args["hint"]
        job = Job(envelope, rid, model, {"model": model, "seed": args["seed"],
                                         "delay": args["delay"]}, hint, now + wait, now)
        self._queue.append(job)
        self._deadlines.add(job)
        self.counters["requests"] += 1

    # -- routing

    def _dispatch(self):
        while self._queue:
            job = self._queue[0]
            s = self._pool.pick(job.model)
            if s is None:
                return
            self._queue.popleft()
            if job.hint and s.last_model != job.model:
                self._hint(s, job.model)
                job.hinted = True
            job.job_id = P.new_rid(next(self._job_ids))
            job.worker = s
            try:
                self._work.send_multipart([s.identity, job.job_id, P.dumps(job.body)], zmq.NOBLOCK)
            except zmq.ZMQError:
                s.ready = False            # its connection is gone; the sentinel will tell why
                self._queue.appendleft(job)
                continue
            s.inflight[job.job_id] = job
            s.last_model = job.model

    def _hint(self, s, model):
        names = s.hints.get(model)
        if not names:
            return
        rid = P.new_rid(next(self._ctl_ids))
        try:
            s.ctl.send_multipart(P.encode_request(rid, "prefetch", {
                "names": names, "wait": False, "priority": 1}), zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters["hints_dropped"] += 1
            return
        self._hints_waiting[rid] = s
        self.counters["hints_sent"] += 1

    # -- workers

    def _on_worker_message(self, frames):
        if len(frames) != 3:
            return
        s = self._pool.by_identity(frames[0])
        if s is None:
            return                          # a previous generation; it is exiting
        if frames[1] == READY:
            self._pool.on_ready(s, P.loads(frames[2]))
            if self._pool.all_ready():
                self._ready_event.set()
            return
        job = s.inflight.pop(frames[1], None)
        if job is None:
            return                          # timed out already
        doc = P.loads(frames[2])
        now = time.monotonic()
        if doc.get("ok"):
            s.served += 1
            result = dict(doc["result"], seconds=now - job.received, hinted=job.hinted,
                          queue_seconds=now - job.received - doc["result"]["compute_seconds"])
            self._send(job.envelope, P.encode_ok(job.rid, result))
        else:
            s.failed += 1
            self._reply_error(job, doc.get("code", P.INTERNAL), doc.get("reason", ""))

    def _on_death(self, s):
        reason, jobs = self._pool.on_death(s, self.respawn and not self._closed)
        for job in jobs:
            self._reply_error(job, P.INTERNAL, reason)
        self.counters["worker_deaths"] += 1
        for rid, slot in list(self._hints_waiting.items()):
            if slot is s:
                self._hints_waiting.pop(rid)
        self._status.on_death(s)
        if self._pool.none_alive():
            self._start_error = RuntimeError("prefetchd serve: no worker could be started")
            self._ready_event.set()

    # -- status (prefetchd.serve.status)

    def _op_status(self, envelope, rid, args, timeout):
        self._status.start(envelope, rid, self._pool.slots, self._status_document)

    def _status_document(self, results):
        return status_document({"endpoint": self.endpoint, "hints": self.hints,
                                "queued": len(self._queue), "models": self.spec.model_names(),
                                "counters": dict(self.counters), "shared_host": self.shared_status()},
                               self._pool.slots, results)

    def _on_control_reply(self, s, frames):
        try:
            rid, doc = P.decode_reply(frames)
        except P.ProtocolError:
            return
        if self._hints_waiting.pop(rid, None) is not None:
            self.counters["hints_ok" if doc.get("ok") else "hints_failed"] += 1
            return
        self._status.on_reply(s, rid, doc)

    # -- timers

    def _run_timers(self):
        now = time.monotonic()
        for job in self._deadlines.expired(now):
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
        self._status.finish(now)
