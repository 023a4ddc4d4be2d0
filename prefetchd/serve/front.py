"""`prefetchd serve`'s front: a ROUTER for inference clients that batches their
requests per model (prefetchd.serve.batching) and routes the batches to N worker
processes (prefetchd.serve.pool) with prefetch hints.

    front (this process)                       worker k (spawned process)
    ROUTER  <- clients: infer/generate/        DEALER -> front work socket
               status/ping                     Daemon + its control Server (ipc)
    ROUTER  -> workers: batches (work socket)  the served models, offloaded
    DEALER  -> each worker's control Server

Requests carry their tensors as frames after the JSON header (prefetchd.serve.wire),
checked against the model's signature before they are queued
(prefetchd.serve.admission); the front forwards the frames to the worker without
a copy, and answers each request with its own rows of the batch's outputs.

A device budget smaller than all the weight sets means switching to another
model has to load its weights. When the front routes a batch to a worker whose
last model is a different one, it first asks that worker's daemon to prefetch
the model's first units; the load then overlaps the batch ahead of it.

The front never blocks on a worker: it polls every worker's process sentinel
with its sockets (one prefetchd.control.ioloop.IOLoop thread), so a worker that
dies fails its in-flight requests at once (INTERNAL, "worker ... died") and is
respawned; one that stops answering its heartbeat (prefetchd.serve.heartbeat) is
killed and replaced the same way; a request that outlives `request_timeout` is
answered TIMEOUT. The `status` op is prefetchd.serve.status.
"""
import functools
import itertools
import logging
import os
import time

import zmq

from ..control import protocol as P
from ..control.codes import BadArguments
from ..control.connections import DEFAULT_MAX_CONNECTIONS
from ..control.ioloop import IOLoop
from ..control.ops import Op, flag, integer
from .admission import MAX_NEW_TOKENS, ModelInfo, admit
from .batching import Batch, Batcher, Job
from .deadlines import Deadlines
from .front_sockets import FrontSockets
from .heartbeat import Heartbeats
from .hints import Hints
from .histograms import BATCH_BUCKETS, QUEUE_BUCKETS, Histogram
from .pool import WorkerPool
from .spec import ServeSpec
from .status import StatusGathers, status_document
from .worker import READY

log = logging.getLogger("prefetchd.serve.front")

TENSOR_OPS = ("infer", "generate")


def _model_name(key, value):
    if not isinstance(value, str):
        raise BadArguments(f"'{key}' must be a model name")
    return value


def _headers(key, value):
    if not isinstance(value, list):
        raise BadArguments(f"'{key}' must be a list of {{dtype, shape}} objects")
    return value


def _spec_of(ops, op, args, tensors):
    """The op table's entry for a request, or BadArguments: an unknown op or argument (e.g. an
    old `delay`: never silently ignored), or tensor frames after an op that takes none."""
    spec = ops.get(op)
    if spec is None:
        raise BadArguments(f"unknown op {op[:64]!r}; known: {', '.join(sorted(ops))}")
    spec.check_known(op, args)
    if tensors and op not in TENSOR_OPS:
        raise BadArguments(f"{len(tensors)} frames after the body; only "
                           f"{' and '.join(TENSOR_OPS)} carry tensors")
    return spec


TENSOR_ARGS = {"model": (_model_name, None), "inputs": (_headers, None), "hint": (flag, None)}
GENERATE_ARGS = dict(TENSOR_ARGS, max_new_tokens=(integer(1, MAX_NEW_TOKENS), None))


class Front(FrontSockets):
    """The front process' router. `start()` spawns the workers and waits until
    they are ready; `close()` stops everything within its timeout. Implements
    prefetchd.control.ioloop.LoopHandler (its lifecycle and sockets are
    prefetchd.serve.front_sockets.FrontSockets)."""

    def __init__(self, endpoint=None, *, workers=2, spec=None, hints=True, request_timeout=30.0,
                 start_timeout=180.0, respawn=True, max_queue=1024, max_inflight_per_worker=2,
                 max_message_size=P.DEFAULT_MAX_MESSAGE_SIZE, name="serve", metrics_port=None,
                 metrics_addr="127.0.0.1", max_batch_size=8, max_queue_delay_ms=2.0,
                 heartbeat_interval=1.0, heartbeat_timeout=15.0,
                 max_connections=DEFAULT_MAX_CONNECTIONS):
        super().__init__(endpoint, name, (spec or ServeSpec()).with_configured_store(),
                         metrics_port, metrics_addr, start_timeout, max_message_size, max_connections,
                         busy=lambda: self._deadlines.waiting_connections())
        self.n_workers = workers
        self.hints = hints
        self.request_timeout = request_timeout
        self.respawn = respawn
        self.max_queue = max_queue
        self._pool = WorkerPool(workers, self._control_endpoint, self._work_endpoint, self.spec,
                                max_inflight_per_worker)
        self._loop = IOLoop(self, f"prefetchd-front-{name}", max_poll=0.5)
        self._ops = {"ping": Op(self._op_ping), "status": Op(self._op_status), "infer": Op(self._op_infer, TENSOR_ARGS),
                     "generate": Op(functools.partial(self._op_infer, kind="generate"), GENERATE_ARGS)}
        self._models = {}              # name -> ModelInfo, from the first worker's READY
        self._batcher = Batcher(max_batch_size, max_queue_delay_ms / 1000.0)
        self._deadlines = Deadlines()
        self.on_unroutable = lambda envelope: self.counters.update(abandoned=self._batcher.abandon(envelope[0]))
        self._request_fd = -1          # the connection of the request being handled (_on_request)
        self._heartbeats = Heartbeats(heartbeat_interval, heartbeat_timeout)
        self._batch_ids = itertools.count(1)
        ctl_ids = itertools.count(1)
        self._new_ctl_rid = lambda: P.new_rid(next(ctl_ids))    # ids of requests to workers' control sockets
        self._hints = Hints(self.counters, self._new_ctl_rid)
        self._status = StatusGathers(self._send, self._new_ctl_rid)
        self.histograms = {}           # model -> {"batch_size": Histogram, "queue_seconds": ...}

    @property
    def max_batch_size(self):
        return self._batcher.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, rows):
        """Batches formed from now on hold at most `rows` rows (1: batching off). Safe from
        any thread: the I/O thread reads this one int each time it forms a batch, and a
        batch already formed or sent keeps its size."""
        if not isinstance(rows, int) or isinstance(rows, bool) or rows < 1:
            raise ValueError(f"max_batch_size must be an int >= 1, not {rows!r}")
        self._batcher.max_batch_size = rows

    def snapshot(self):
        """What the front's metrics report, copied (so safe from another thread)."""
        return {"counters": dict(self.counters), "errors": dict(self.counters.errors),
                "queued": len(self._batcher),
                "workers": [s.public() for s in list(self._pool.slots)],
                "histograms": {m: {k: h.snapshot() for k, h in hs.items()}
                               for m, hs in list(self.histograms.items())},
                "shared_host": self.shared_status()}

    # -- LoopHandler (I/O thread); setup/teardown are FrontSockets'

    def _serving_items(self):
        items = [(self._router, self._on_request, False), (self._work, self._on_worker_message, False)]
        for s in self._pool.slots:
            if s.ctl is not None:
                items.append((s.ctl, lambda frames, s=s: self._on_control_reply(s, frames)))
            if s.process is not None:
                items.append((s.process.sentinel, lambda s=s: self._on_death(s)))
        return items + self.connections.poll_items()

    def _serving_tick(self):
        self.connections.tick()
        self._dispatch()
        self._run_timers()

    def poll_timeout(self):
        # A batch whose delay has run out waits for a worker with room, and a worker's
        # reply (a socket event) is what makes room: counting its past wakeup time
        # would poll with timeout 0, spinning a core the workers need, until then.
        batch_due = self._batcher.next_wakeup() if self._pool.has_room() else None
        nearest = min((t for t in (self._deadlines.nearest(), self._status.nearest_deadline(),
                                   batch_due, self._heartbeats.next_due(), self.connections.wake_at,
                                   self._pool.next_retry())
                       if t is not None), default=None)
        return None if nearest is None else nearest - time.monotonic()

    def outstanding_jobs(self):
        """Every job not yet answered (teardown answers them SHUTDOWN)."""
        return self._batcher.drain() + [job for batch in self._pool.take_inflight()
                                        for job in batch.pending()]

    # -- replies

    def _fail(self, job, code, reason):
        job.finish()     # (a worker's refusal is named by the op, as the front's own are)
        self._reply_error(job.envelope, job.rid, code, f"{job.kind}: {reason}" if code == P.BAD_REQUEST else reason)

    # -- clients: the op table

    def _on_request(self, frames):
        envelope, request, tensors = self._received(frames)
        if request is None:           # undecodable (answered), or its connection dropped or closed (not)
            return
        rid, op, args, timeout = request
        try:
            spec = _spec_of(self._ops, op, args, tensors)
            spec.handler(envelope, rid, spec.validate(args, op), timeout, tensors)
        except BadArguments as e:     # (a client's op is cut: a 5000-character one hid the reason)
            self._reply_error(envelope, rid, P.BAD_REQUEST, f"{op[:64]}: {e}")
        except Exception as e:    # a defect here must not leave the request unanswered
            log.exception("prefetchd serve: %s request failed", op[:64])
            self._reply_error(envelope, rid, P.INTERNAL, f"{op[:64]}: internal error ({type(e).__name__})")

    def _op_ping(self, envelope, rid, args, timeout, tensors):
        self._send(envelope, P.encode_ok(rid, {
            "pong": True, "protocol": P.MAGIC.decode(), "pid": os.getpid(),
            "workers": sum(s.ready for s in self._pool.slots), "models": self.spec.model_names(),
            "max_batch_size": self._batcher.max_batch_size}))

    def _op_infer(self, envelope, rid, args, timeout, tensors, kind="infer"):
        model = args["model"]
        info = self._models.get(model)
        if info is None:
            if model in self.spec.model_names():
                self._reply_error(envelope, rid, P.BUSY, "no worker has started yet")
                return
            raise BadArguments((f"unknown model {str(model)[:64]!r}" if model is not None else "needs 'model'")
                               + f"; models: {', '.join(self.spec.model_names())}")
        if args["inputs"] is None:
            raise BadArguments("needs 'inputs': a {dtype, shape} header per tensor frame")
        rows, key = admit(info, kind, args["inputs"], tensors, self.spec.max_tensor_bytes,
                          args.get("max_new_tokens"))
        if self._batcher.full_for(envelope[0], self.max_queue):
            self.counters["busy"] += 1
            self._reply_error(envelope, rid, P.BUSY, f"{len(self._batcher)} requests queued")
            return
        now = time.monotonic()
        wait = min(timeout or self.request_timeout, self.request_timeout)
        hint = self.hints if args["hint"] is None else args["hint"]
        job = Job(envelope, rid, model, kind, args["inputs"], list(tensors), rows, key, hint,
                  now + wait, now, args.get("max_new_tokens"), fd=self._request_fd)
        self._batcher.add(job)
        self._deadlines.add(job)
        self.counters["requests"] += 1

    # -- batching and routing

    def _dispatch(self):
        now = time.monotonic()
        while True:                       # one batch at a time: the first ready model may change
            ready = self._batcher.ready_models(now)
            s = self._pool.pick(ready[0]) if ready else None
            if s is None:
                return
            self._send_batch(s, ready[0], self._batcher.take(ready[0], functools.partial(s.parts_for, ready[0])), now)

    def _send_batch(self, s, model, jobs, now):
        batch = Batch(P.new_rid(next(self._batch_ids)), model, jobs, s, now)
        if any(j.hint for j in jobs) and s.last_model != model:
            batch.hinted = self._hints.send(s, model)
        try:
            self._work.send_multipart([s.identity, batch.job_id, P.dumps(batch.body()),
                                       *batch.frames()], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            s.ready = False            # its connection is gone; the sentinel will tell why
            for job in reversed(jobs):
                self._batcher.add(job, first=True)
            return
        self.histograms.setdefault(model, {"batch_size": Histogram(BATCH_BUCKETS),
                                           "queue_seconds": Histogram(QUEUE_BUCKETS)})
        for job in jobs:
            job.batch = batch
        s.inflight[batch.job_id] = batch
        s.last_model = model
        self.counters["batches"] += 1

    # -- workers

    def _on_worker_message(self, frames):
        if len(frames) < 3:
            return
        s = self._pool.by_identity(frames[0].bytes)
        if s is None:
            return                          # a previous generation; it is exiting
        if frames[1].bytes == READY:
            info = P.loads(frames[2].bytes)
            self._pool.on_ready(s, info)
            self._heartbeats.on_ready(s)
            for name, doc in info["models"].items():
                self._models.setdefault(name, ModelInfo.from_json(doc))
            if self._pool.settled():
                self._ready_event.set()
            return
        batch = s.inflight.pop(frames[1].bytes, None)
        if batch is not None:
            self._on_batch_reply(s, batch, P.loads(frames[2].bytes), frames[3:])

    def _on_batch_reply(self, s, batch, doc, out_frames):
        if not doc.get("ok"):
            s.count_reply(len(batch.jobs), [doc.get("code")] * len(batch.jobs))
            for job in batch.pending():
                self._fail(job, doc.get("code", P.INTERNAL), doc.get("reason", ""))
            return
        now, r, at = time.monotonic(), doc["result"], 0
        s.joined[(batch.model, batch.jobs[0].kind)] = r.get("joined")
        s.count_reply(len(batch.jobs), [e["code"] for e in r["errors"].values()])
        hs = self.histograms[batch.model]
        for rows in r["forwards"]:          # the forwards it ran: joined, or one per request
            hs["batch_size"].observe(rows)
        # Queued until the worker began it: in the front, then behind the batch the worker
        # was running (its in-flight slots). The clock is the machine's (serve.execute).
        began = r.get("started", batch.sent)
        for i, (job, headers) in enumerate(zip(batch.jobs, r["outputs"])):
            error = r["errors"].get(str(i))
            frames, at = ([], at) if error else (out_frames[at:at + len(headers)], at + len(headers))
            hs["queue_seconds"].observe(began - job.received)
            if job.done:
                continue                    # timed out already
            if error:                       # this request's own failure, not its batch-mates'
                self._fail(job, error["code"], error["reason"])
                continue
            job.finish()
            self._send(job.envelope, P.encode_ok(job.rid, {
                "model": batch.model, "worker": r["worker"], "pid": r["pid"], "outputs": headers,
                "batch_size": r["ran"][i], "compute_seconds": r["compute_seconds"],
                "queue_seconds": began - job.received, "seconds": now - job.received,
                "hinted": batch.hinted}, frames))

    def _on_death(self, s):
        reason, batches = self._pool.on_death(s, self.respawn and not self._closed)
        for batch in batches:
            for job in batch.pending():
                self._fail(job, P.INTERNAL, reason)
        self.counters["worker_deaths"] += 1
        self._hints.forget(s)
        self._heartbeats.forget(s)
        self._status.on_death(s)
        if self._pool.none_alive():
            why = s.start_error or f"it ended ({s.exit_how}) before it was ready, with no error to report"
            self._start_error = RuntimeError(f"prefetchd serve: no worker could be started{' again' if self._models else ''}: "
                                             f"worker {s.index}: {why} (--debug shows its traceback)")
        if self._pool.settled():           # starting: this one gave up, the rest are ready (or none is left)
            self._ready_event.set()

    def _replace_hung(self, s):
        """A worker that stopped answering: fail its requests now, kill it (the sentinel respawns it)."""
        silent = self._heartbeats.timeout
        log.warning("prefetchd serve: worker %d (pid %s) answered no heartbeat for %.3gs; "
                    "replacing it", s.index, s.pid, silent)
        self.counters["workers_hung"] += 1
        self._heartbeats.forget(s)
        for batch in self._pool.replace_hung(s):
            for job in batch.pending():
                self._fail(job, P.INTERNAL, f"worker {s.index} (pid {s.pid}) hung: no "
                                                   f"heartbeat for {silent:.3g}s; replaced")

    # -- status (prefetchd.serve.status) and control replies

    def _op_status(self, envelope, rid, args, timeout, tensors):
        self._status.start(envelope, rid, self._pool.slots, self._status_document)

    def _status_document(self, results):
        return status_document({"endpoint": self.endpoint, "hints": self.hints,
                                "queued": len(self._batcher), "models": self.spec.model_names(),
                                "max_batch_size": self._batcher.max_batch_size,
                                "counters": dict(self.counters), "errors": dict(self.counters.errors),
                                "shared_host": self.shared_status(), **self.connections.counts()},
                               self._pool.slots, results)

    def _on_control_reply(self, s, frames):
        try:
            rid, doc = P.decode_reply(frames)
        except P.ProtocolError:
            return
        if self._heartbeats.heard(s, rid):
            return
        if self._hints.on_reply(rid, doc):
            return
        self._status.on_reply(s, rid, doc)

    # -- timers

    def _run_timers(self):
        now = time.monotonic()
        for job in self._deadlines.expired(now):
            if job.done:
                continue
            if job.batch is None:
                self._batcher.remove(job)
            self.counters["timeouts"] += 1
            where = (f"on worker {job.batch.worker.index}" if job.batch else "waiting for a worker")
            self._fail(job, P.TIMEOUT, f"{job.kind} did not complete within "
                                              f"{job.deadline - job.received:.3g}s ({where})")
        self._heartbeats.attend(now)
        for s in self._heartbeats.hung(self._pool.slots, now):
            self._replace_hung(s)
        self._heartbeats.ping_due(self._pool.slots, now, self._new_ctl_rid)
        self._pool.retry_due(now)
        self._status.finish(now)
