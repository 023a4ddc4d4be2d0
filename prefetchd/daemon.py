"""The daemon: one scheduler thread that owns residency and keeps the device tier
under its watermark.

Any thread submits requests (prefetch, evict, pin, unpin, flush, watermarks,
register); they enter one queue and return futures. The scheduler thread is
the only one that changes residency state. It blocks in the backend's
completion queue, which both finished transfers and new requests wake
(no polling). Shape after CPython's concurrent.futures.thread: one loop, a
wake-up on submit, state flags under one lock, refusals that say why.

Invariants (DESIGN.md section 4), enforced here:
1. device bytes reserved never exceed the high watermark; crossing it evicts
   down to the low watermark;
2. pinned tensors are never evicted or moved;
3. a dirty replica is dropped only after its write-back was read back and verified;
4. device memory that compute may have read is reused only after a compute fence;
5. reads from the remote tier are verified by checksum (native FileStore).
"""
import atexit
import collections
import contextlib
import fnmatch
import heapq
import itertools
import logging
import threading
import time
import weakref
from concurrent.futures import Future, InvalidStateError

import numpy as np

from . import _native, backend as backends
from . import guard, policy as policies
from .backend import framework
from .backend.base import TransferKind
from .config import Config, parse_fraction_or_size
from .errors import (BudgetError, DoubleRegisterError, IntegrityError, NotResidentError,
                     PinnedError, PrefetchdError, ShutdownError, StorageError, UnknownTensorError)
from .residency import ManagedTensor, State
from .stats import Stats

log = logging.getLogger("prefetchd")

_DONE = Future()          # shared, already-resolved future for requests satisfied on the spot
_DONE.set_result(None)

live_daemons = weakref.WeakSet()   # started, not yet closed: what prefetchd.tier() consults

_MAX_LOADS_IN_FLIGHT = 4  # enough to keep the store's queue full; more only delays priorities



@atexit.register
def _close_live_daemons():
    """Daemons still open at interpreter exit (or whose close() was interrupted) stop
    here, so no native thread outlives the interpreter."""
    for daemon in list(live_daemons):
        try:
            daemon.close(min(5.0, daemon.config.shutdown_timeout))
        except BaseException:
            log.exception("prefetchd %s: close at exit failed", daemon.name)


class TensorHandle:
    """What register() returns: a name bound to one daemon."""

    __slots__ = ("name", "_rec", "__weakref__")

    def __init__(self, rec):
        self.name = rec.name
        self._rec = rec

    nbytes = property(lambda self: self._rec.nbytes)
    shape = property(lambda self: self._rec.shape)
    dtype = property(lambda self: self._rec.dtype)
    state = property(lambda self: self._rec.state)
    tiers = property(lambda self: self._rec.tiers)
    target = property(lambda self: self._rec.target)

    def __repr__(self):
        r = self._rec
        return f"<TensorHandle {r.name!r} {r.nbytes} B {r.state.value} tiers={r.tiers}>"


class _Request:
    """One submitted request; `remaining` counts tensors not yet satisfied."""

    __slots__ = ("kind", "recs", "future", "priority", "deadline", "seq", "submitted", "remaining",
                 "pinned", "args", "demand")

    def __init__(self, kind, recs=(), future=None, priority=0, deadline=None, args=None):
        self.kind = kind
        self.recs = recs
        self.future = future
        self.priority = priority
        self.deadline = deadline
        self.seq = 0
        self.submitted = time.monotonic()
        self.remaining = 0
        self.pinned = []
        self.args = args
        self.demand = kind in ("pin", "register", "fetch")  # may evict prefetched-unused tensors


class Daemon:
    """An in-process tiered-memory daemon. See docs/daemon-api.md for the contract."""

    def __init__(self, config=None, *, backend=None, **overrides):
        if config is None:
            config = Config.load(**overrides)
        elif overrides:
            config = config.replace(**overrides)
        self.config = config
        self.name = config.name
        self.stats = Stats()
        self._backend_arg = backend
        self.backend = None
        self._policy = policies.create(config.policy)
        self._lock = threading.Lock()
        self._state = "new"           # new -> running -> closing -> closed
        self._records = {}            # name -> ManagedTensor
        self._targets = {}            # id(framework tensor) -> name (one tensor, one name)
        self._inbox = collections.deque()
        self._loads = []              # heap: (speculative?, deadline, -priority, seq, -nbytes, n, rec, request)
        self._loads_in_flight = 0
        self._inflight = {}           # tag -> (kind, rec, request or None)
        self._unfenced = []           # (block, compute epoch or None): released, maybe still read
        self._waiting_room = []       # evict/flush requests waiting on transfers: (request, recs)
        self._tags = itertools.count(1)
        self._seq = itertools.count()
        self._tick = itertools.count(1)
        self._high = config.high_watermark
        self._low = config.low_watermark
        self._peak = 0
        self._listeners = []
        self._reserve_checks = []     # test hooks: fn(used_after, high) on every reservation
        self._fence_watcher = None    # wakes the scheduler when a compute-fence epoch is reached
        self._thread = None
        self._exporter = None
        self._server = None
        self._closed_reason = "cannot schedule new requests after close()"
        self._started = False
        self._shutdown_sent = False

    # ------------------------------------------------------------------ lifecycle
    def start(self):
        with self._lock:
            if self._state == "running":
                return self
            if self._state != "new":
                raise ShutdownError("cannot start a daemon after close()")
            self.backend = self._backend_arg or backends.create(self.config)
            self._state = "running"
            live_daemons.add(self)
        self._thread = threading.Thread(target=_scheduler_loop, args=(weakref.ref(self),),
                                        name=f"prefetchd-scheduler-{self.name}", daemon=True)
        self._thread.start()
        try:
            if self.config.metrics_port is not None:
                from .metrics import start_exporter
                self._exporter = start_exporter(self, self.config.metrics_addr, self.config.metrics_port)
            if self.config.endpoint:
                self.serve(self.config.endpoint)
        except BaseException:
            self.close()      # e.g. the metrics port is taken: leave no thread behind
            raise
        return self

    def serve(self, endpoint, **kwargs):
        """Answer other processes over ZeroMQ at `endpoint` (see prefetchd.service)."""
        from .service import Server
        self._check_open()
        self._server = Server(self, endpoint, **kwargs).start()
        return self._server

    @property
    def metrics_port(self):
        return self._exporter.port if self._exporter else None

    @property
    def closed(self):
        return self._state == "closed"

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def close(self, timeout=None):
        """Stop within `timeout` seconds: finish write-backs if time allows, cancel the rest.

        Dirty replicas whose write-back cannot finish in time are reported
        (logged) — close() never waits past its bound. Safe to call again, also
        after an interrupted close (an atexit hook does, for daemons left open).
        """
        timeout = self.config.shutdown_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._lock:
            if self._state == "closed":
                return
            first = self._state != "closing"
            if first:
                self._started = self._state != "new"
                self._state = "closing"
        if first:
            stops = []
            if self._server is not None:
                stops.append(lambda: self._server.close(max(0.1, (deadline - time.monotonic()) / 2)))
            if self._exporter is not None:
                stops.append(self._exporter.close)
            for stop in stops:
                try:
                    stop()
                except Exception:   # keep closing: the scheduler and memory matter more
                    log.exception("prefetchd %s: stopping the server or exporter failed", self.name)
        if self._started:
            if not self._shutdown_sent:
                self._shutdown_sent = True
                self._inbox.append(_Request("shutdown", args=deadline))
                self.backend.notify()
            self._thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
            if self._thread.is_alive():
                log.error("prefetchd %s: scheduler did not stop within %.1fs", self.name, timeout)
                return
        with self._lock:
            self._state = "closed"
            live_daemons.discard(self)

    def _check_open(self):
        if self._state != "running":
            if self._state == "new":
                raise ShutdownError("daemon not started: call start() or use it as a context manager")
            raise ShutdownError(self._closed_reason)

    def _submit(self, request):
        with self._lock:
            self._check_open()
            request.seq = next(self._seq)
            self._inbox.append(request)
        self.backend.notify()
        return request.future

    # ------------------------------------------------------------------ registration
    def register(self, tensor, name=None, *, tier="device"):
        """Manage `tensor` (a mindspore Tensor or Parameter) under `name`.

        tier: where the data goes now: "device" (a device replica; dirty until
        first written back), "host", or "remote" (written to the store and
        verified; the framework tensor then releases its memory).
        """
        if tier not in ("device", "host", "remote"):
            raise ValueError(f"tier must be 'device', 'host' or 'remote', not {tier!r}")
        name = name or getattr(tensor, "name", None)
        if not name:
            raise ValueError("register() needs a name for a tensor that has none")
        self._check_open()
        array = np.ascontiguousarray(framework.host_copy(tensor))
        with self._lock:
            if name in self._records:
                raise DoubleRegisterError(f"a tensor named {name!r} is already registered")
            if id(tensor) in self._targets:
                raise DoubleRegisterError(
                    f"this tensor is already registered as {self._targets[id(tensor)]!r}")
            rec = ManagedTensor(name=name, shape=tuple(array.shape), dtype=array.dtype,
                                nbytes=array.nbytes, target=tensor)
            self._records[name] = rec
            self._targets[id(tensor)] = name
        future = Future()
        try:
            self._submit(_Request("register", (rec,), future, args=(array, tier)))
            future.result()
        except BaseException:
            with self._lock:
                self._forget(rec)
            raise
        if tier == "device":
            self._bind_for_compute(rec)
            self._track(rec)
        else:
            framework.bind_placeholder(tensor, rec.dtype)
            self._guard(rec)
        return TensorHandle(rec)

    def register_remote(self, name, shape, dtype, *, target=None):
        """Manage a tensor whose data is already in the store under `name`."""
        self._check_open()
        info = self.backend.store_info(name)
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize if len(shape) else dtype.itemsize
        if info["nbytes"] != nbytes:
            raise ValueError(f"{name!r}: the store holds {info['nbytes']} bytes, "
                             f"but shape {tuple(shape)} of {dtype} needs {nbytes}")
        rec = ManagedTensor(name=name, shape=tuple(shape), dtype=dtype, nbytes=nbytes,
                            target=target, remote_valid=True)
        with self._lock:
            if name in self._records:
                raise DoubleRegisterError(f"a tensor named {name!r} is already registered")
            if target is not None and id(target) in self._targets:
                raise DoubleRegisterError(
                    f"this tensor is already registered as {self._targets[id(target)]!r}")
            self._records[name] = rec
            if target is not None:
                self._targets[id(target)] = name
        if target is not None:
            framework.bind_placeholder(target, dtype)
            self._guard(rec)
        return TensorHandle(rec)

    def register_checkpoint(self, model, *, checkpoint=None):
        """Register every parameter of `model` from the store: its remote replica is the data.

        checkpoint: a .ckpt/.safetensors file to stage into this daemon's store
        first (tensor by tensor); None if the store already holds the tensors
        (e.g. `prefetchd stage`). The model may be built with
        `no_init_parameters`: its weights never need to exist in RAM.
        """
        from . import staging
        self._check_open()
        if checkpoint is not None:
            staging.stage_tensors(_StoreWriter(self.backend), staging.iter_checkpoint(checkpoint))
        handles = []
        for p in model.get_parameters():
            if not self.backend.store_contains(p.name):
                raise UnknownTensorError(f"the store has no tensor for parameter {p.name!r}")
            shape, dtype = staging.read_meta(self.backend.store_info(p.name))
            if tuple(shape) != tuple(p.shape):
                raise ValueError(f"{p.name!r}: the store holds shape {tuple(shape)}, "
                                 f"the model expects {tuple(p.shape)}")
            handles.append(self.register_remote(p.name, shape, dtype, target=p))
        return handles

    def handle(self, name):
        return TensorHandle(self._record(name))

    def names(self):
        with self._lock:
            return list(self._records)

    def _record(self, item):
        if isinstance(item, TensorHandle):
            return item._rec
        if isinstance(item, ManagedTensor):
            return item
        if isinstance(item, str):
            rec = self._records.get(item)
            if rec is None:
                raise UnknownTensorError(f"no tensor named {item!r} is registered with daemon {self.name!r}")
            return rec
        name = self._targets.get(id(item))
        if name is None:
            raise UnknownTensorError(f"{type(item).__name__} is not registered with daemon {self.name!r}")
        return self._records[name]

    def _records_of(self, tensors):
        if isinstance(tensors, (str, TensorHandle, ManagedTensor)) or framework.is_tensor(tensors):
            tensors = (tensors,)
        recs = tuple(self._record(t) for t in tensors)
        if len({id(r) for r in recs}) != len(recs):
            recs = tuple({id(r): r for r in recs}.values())
        return recs

    # ------------------------------------------------------------------ requests
    def prefetch(self, tensors, priority=0, deadline=None):
        """Make tensors resident soon. Resolves when they are; never pins them."""
        recs = self._records_of(tensors)
        self._check_open()
        if all(r.state is State.RESIDENT for r in recs):
            # Hit: nothing to schedule. Reading `state` races only with an eviction
            # that could follow a queued hit just as well.
            tick = next(self._tick)
            for r in recs:
                r.last_use = tick
            with self._lock:
                self.stats.requests["prefetch", "hit"] += 1
            return _DONE
        for r in recs:
            r.requested = True    # until the scheduler has queued it (see acquire)
        return self._submit(_Request("prefetch", recs, Future(), priority, deadline))

    def pin(self, tensors, priority=0):
        """Wait until resident, then pin (never evicted or moved until unpinned)."""
        return self._submit(_Request("pin", self._records_of(tensors), Future(), priority))

    def unpin(self, tensors):
        self._submit(_Request("unpin", self._records_of(tensors)))

    def evict(self, tensors):
        """Drop device replicas (writing dirty ones back first). Fails on pinned tensors."""
        return self._submit(_Request("evict", self._records_of(tensors), Future()))

    def flush(self, tensors=None):
        """Write dirty device replicas back to the remote tier; resolves when verified."""
        recs = None if tensors is None else self._records_of(tensors)
        return self._submit(_Request("flush", recs, Future()))

    def stage_to_host(self, tensors):
        """Give tensors a host replica read from the remote tier (weights-in-RAM setups)."""
        return self._submit(_Request("stage", self._records_of(tensors), Future()))

    def set_watermarks(self, high, low=None):
        budget = self.config.device_budget
        high_b = parse_fraction_or_size(high, budget, "high_watermark")
        low_b = parse_fraction_or_size(low, budget, "low_watermark") if low is not None else int(high_b * 0.85)
        if high_b > budget:
            raise ValueError(f"high watermark {high_b} exceeds the device budget {budget}")
        if low_b > high_b:
            raise ValueError(f"low watermark {low_b} is above the high watermark {high_b}")
        return self._submit(_Request("watermarks", (), Future(), args=(high_b, low_b)))

    def mark_dirty(self, tensors):
        for rec in self._records_of(tensors):
            self._on_user_write(rec, "mark_dirty")

    @contextlib.contextmanager
    def use(self, tensors, auto_fetch=True):
        """Pin `tensors` for compute: waits for residency, binds, unpins on exit."""
        recs = self._records_of(tensors)
        self.acquire(recs, auto_fetch=auto_fetch)
        try:
            yield recs
        finally:
            self.unpin(recs)

    def acquire(self, recs, *, auto_fetch=True, stall_timeout=None):
        """Pin and bind records for compute on the calling thread; returns stall seconds.

        With auto_fetch=False a tensor that is neither resident nor on its way
        raises NotResidentError instead of being fetched.
        """
        if not auto_fetch:
            # A miss: absent, and no load queued or in flight for it.
            with self._lock:
                missing = next((r for r in recs if r.state is State.ABSENT and not r.requested
                                and not r.waiters), None)
                if missing is not None:
                    self._count("fetch", "miss")
            if missing is not None:
                raise NotResidentError(missing.name, ",".join(missing.tiers), missing.state.value)
        started = time.perf_counter()
        future = self.pin(recs)
        future.result(timeout=stall_timeout)
        stall = time.perf_counter() - started
        for rec in recs:
            self._bind_for_compute(rec)
        self.note_stall(stall)
        return stall

    # ------------------------------------------------------------------ trace (from the layer hooks)
    def set_trace(self, steps, owner=None):
        """A recorded execution order (one collection of tensor names per unit run) of `owner`."""
        with self._lock:
            self._policy.set_trace(steps, owner)

    def advance_trace(self, position, owner=None):
        with self._lock:
            self._policy.advance(position, owner)

    def status_watermark(self):
        """The high watermark in bytes (cheap; no lock)."""
        return self._high

    def compute_marker(self):
        """Per-unit compute fences for the layer hooks (None: whole-queue fences only)."""
        return self.backend.compute_marker()

    def compute_done(self, recs, epoch):
        """Every read of these tensors so far is covered by compute-fence `epoch`."""
        with self._lock:
            for rec in recs:
                rec.compute_epoch = epoch

    def note_stall(self, seconds):
        with self._lock:
            self.stats.stall.observe(seconds)

    def note_resync(self):
        with self._lock:
            self.stats.trace_resyncs += 1

    # ------------------------------------------------------------------ introspection
    def status(self):
        with self._lock:
            return self._status()

    def _status(self):
        states = dict.fromkeys((s.value for s in State), 0)
        pinned = pinned_bytes = 0
        for rec in self._records.values():
            states[rec.state.value] += 1
            if rec.pins:
                pinned += 1
                pinned_bytes += rec.nbytes
        be = self.backend
        used = be.device_used() if be else 0
        cap = self.config.device_budget
        return {
            "name": self.name,
            "closed": self._state in ("closing", "closed"),
            "backend": self.config.backend,
            "io_engine": be.io_engine if be else None,
            "device": {"capacity": cap, "used": used, "peak": self._peak,
                       "high_watermark": self._high, "low_watermark": self._low,
                       "usage_ratio": used / cap if cap else 0.0},
            "host": {"budget": self.config.host_budget, "used": be.host_used() if be else 0},
            "remote": {"bytes": be.store_bytes() if be and self._state == "running" else 0},
            "queue_depth": len(self._inbox) + len(self._loads),
            "in_flight": len(self._inflight),
            "pinned": pinned, "pinned_bytes": pinned_bytes,
            "tensors": len(self._records), "states": states,
        }

    def snapshot(self):
        """(status, stats) copied together under the lock: what one metrics scrape sees."""
        with self._lock:
            return self._status(), self.stats.snapshot()

    def tensors(self, pattern="*"):
        with self._lock:
            return [r.describe() for name, r in self._records.items() if fnmatch.fnmatchcase(name, pattern)]

    def add_listener(self, fn):
        self._listeners.append(fn)

    def remove_listener(self, fn):
        with contextlib.suppress(ValueError):
            self._listeners.remove(fn)

    # ------------------------------------------------------------------ compute-thread helpers
    def _bind_for_compute(self, rec):
        """Point the framework tensor at the device replica (on the calling thread)."""
        if rec.target is None:
            return
        with self._lock:
            block = rec.block
            if block is None:
                raise NotResidentError(rec.name, ",".join(rec.tiers), rec.state.value)
            rebind = rec.bound_address != block.address
            rec.exposed = True
            rec.compute_epoch = None     # read by compute from now on, until a fence says otherwise
        if rebind:
            self.backend.bind(rec.target, block, rec.shape, rec.dtype)
            rec.bound_address = block.address
        if guard.is_guarded(rec.target):
            self._track(rec)

    def _track(self, rec):
        guard.track(rec.target, rec.name, lambda method, rec=rec: self._on_user_write(rec, method))

    def _on_user_write(self, rec, method):
        """The user wrote a managed tensor through its Python API (caller's thread)."""
        if method in ("set_data", "assign_value"):
            self._adopt(rec)
        with self._lock:
            if rec.state in (State.RESIDENT, State.STORING):
                rec.dirty = True
                rec.generation += 1

    def _adopt(self, rec):
        """The user gave the tensor new storage: copy its values into the device
        replica and point the tensor back at it, so the write-back keeps them."""
        values = framework.host_copy(rec.target)
        with self._lock:
            block = rec.block
            if block is None or values.nbytes != rec.nbytes:
                raise PrefetchdError(
                    f"{rec.name!r} is managed by prefetchd: set_data must keep its shape and dtype "
                    f"({rec.shape}, {rec.dtype}); got {values.shape}, {values.dtype}")
            view = self.backend.view(block, rec.shape, rec.dtype)
        view[...] = values.reshape(rec.shape)
        self.backend.bind(rec.target, block, rec.shape, rec.dtype)
        rec.bound_address = block.address

    def _guard(self, rec):
        if rec.target is not None:
            guard.guard(rec.target, lambda rec=rec: NotResidentError(
                rec.name, ",".join(rec.tiers), rec.state.value))

    def _forget(self, rec):
        self._records.pop(rec.name, None)
        if rec.target is not None:
            self._targets.pop(id(rec.target), None)

    # ------------------------------------------------------------------ scheduler side
    # Everything below runs on the scheduler thread, under self._lock.

    def _emit(self, event, rec, seconds=0.0, error=None):
        if self._listeners:
            payload = {"event": event, "name": rec.name, "nbytes": rec.nbytes,
                       "seconds": seconds, "error": error}
            for fn in list(self._listeners):
                try:
                    fn(payload)
                except Exception:  # a listener must not take the scheduler down
                    log.exception("prefetchd listener failed")

    def _count(self, op, outcome):
        if op != "register":
            self.stats.requests[op, outcome] = self.stats.requests.get((op, outcome), 0) + 1

    def _handle(self, req, resolved):
        kind = req.kind
        if req.future is not None and req.future.cancelled():
            self._count(kind, "cancelled")
            return
        self.stats.queue_wait.observe(time.monotonic() - req.submitted)
        if kind in ("prefetch", "pin", "register"):
            self._want_resident(req, resolved)
        elif kind == "unpin":
            for rec in req.recs:
                if rec.pins > 0:
                    rec.pins -= 1
                    rec.last_use = next(self._tick)
        elif kind == "evict":
            self._evict_request(req, resolved)
        elif kind == "flush":
            self._flush_request(req, resolved)
        elif kind == "stage":
            self._stage_request(req, resolved)
        elif kind == "watermarks":
            self._high, self._low = req.args
            self._make_room(0, demand=True)
            self._resolve(req, None, resolved)

    def _want_resident(self, req, resolved):
        if req.kind == "register":
            rec = req.recs[0]
            array, tier = req.args
            rec.initial = array
            if tier == "device":
                req.remaining = 1
                rec.waiters.append(req)
                self._queue_load(rec, req)
            else:
                self._start_initial_store(rec, req, tier, resolved)
            return
        missing = []
        for rec in req.recs:
            rec.requested = False      # from here on, waiters and the load queue say it
            if rec.state in (State.RESIDENT, State.STORING):
                if req.kind == "pin":
                    rec.pins += 1
                    req.pinned.append(rec)
                    rec.prefetched_unused = False
                rec.last_use = next(self._tick)
                continue
            if rec.state is State.ABSENT and not (rec.remote_valid or rec.host_valid):
                self._fail_request(req, NotResidentError(
                    rec.name, "", rec.state.value,
                    f"tensor {rec.name!r} has no valid replica on any tier (freed or never written)"),
                    resolved)
                return
            missing.append(rec)
        op = "fetch" if req.kind == "pin" else req.kind
        if not missing:
            self._count(op, "hit")
            self._resolve(req, None, resolved)
            return
        self._count(op, "miss" if req.kind == "pin" else "issued")
        req.remaining = len(missing)
        for rec in missing:
            rec.waiters.append(req)
            if rec.state is State.ABSENT:
                self._queue_load(rec, req)

    def _stage_request(self, req, resolved):
        todo = [r for r in req.recs if not r.host_valid]
        for rec in todo:
            if not rec.remote_valid:
                self._fail_request(req, StorageError(
                    f"cannot stage {rec.name!r} to the host tier: it has no remote replica"), resolved)
                return
        req.remaining = len(todo)
        for rec in todo:
            if not self._alloc_host(rec, req, resolved):
                return
            tag = next(self._tags)
            self._inflight[tag] = (TransferKind.STAGE, rec, req)
            self.backend.start_load(rec.name, rec.host_block, rec.nbytes, tag, self.config.verify_reads)
        if not todo:
            self._resolve(req, None, resolved)

    def _queue_load(self, rec, req):
        # Compute waiting on a tensor (pin) goes before speculation (prefetch).
        deadline = req.deadline if req.deadline is not None else float("inf")
        # Within one request, largest first: big blocks placed first fragment the arena least.
        heapq.heappush(self._loads, (not req.demand, deadline, -req.priority, req.seq, -rec.nbytes,
                                     next(self._seq), rec, req))

    def _pump_loads(self, resolved):
        """Start queued loads in priority order while memory and stream slots allow."""
        while self._loads and self._loads_in_flight < _MAX_LOADS_IN_FLIGHT:
            *_, rec, req = self._loads[0]
            rec.waiters = [w for w in rec.waiters if not w.future.cancelled()]
            if rec.state is not State.ABSENT or not rec.waiters:
                heapq.heappop(self._loads)   # satisfied, or every waiter gone
                continue
            try:
                block = self._reserve(rec.nbytes, demand=req.demand, incoming=rec)
            except BudgetError as e:
                heapq.heappop(self._loads)
                self._fail_waiters(rec, e, resolved)
                continue
            if block is None:
                if self._inflight or self._unfenced:
                    return    # write-backs or loads in flight will free or settle memory
                # Nothing in flight can change the picture: say so instead of waiting forever.
                heapq.heappop(self._loads)
                self._fail_waiters(rec, BudgetError(
                    f"cannot load {rec.name!r} ({rec.nbytes} bytes): the device tier is held by pinned "
                    f"tensors, prefetched tensors not used yet, or tensors whose write-back failed "
                    f"(used {self.backend.device_used()} of high watermark {self._high} bytes)"), resolved)
                continue
            heapq.heappop(self._loads)
            self._start_load(rec, block)

    def _start_load(self, rec, block):
        rec.state = State.LOADING
        rec.block = block
        rec.exposed = False
        tag = next(self._tags)
        self._loads_in_flight += 1
        if rec.initial is not None:
            self._inflight[tag] = (TransferKind.H2D, rec, None)
            self.backend.start_copy(TransferKind.H2D, block, rec.initial, rec.nbytes, tag,
                                    shape=rec.shape, dtype=rec.dtype)
        elif rec.host_valid:
            self._inflight[tag] = (TransferKind.H2D, rec, None)
            self.backend.start_copy(TransferKind.H2D, block, rec.host_block, rec.nbytes, tag,
                                    shape=rec.shape, dtype=rec.dtype)
        else:
            self._inflight[tag] = (TransferKind.LOAD, rec, None)
            self.backend.start_load(rec.name, block, rec.nbytes, tag, self.config.verify_reads,
                                    shape=rec.shape, dtype=rec.dtype)

    def _alloc_host(self, rec, req, resolved):
        """Give rec a host block, or fail req saying why (the host budget is exact)."""
        try:
            rec.host_block = self.backend.alloc_host(rec.nbytes)
            return True
        except Exception as e:
            self._fail_request(req, BudgetError(
                f"cannot stage {rec.name!r} ({rec.nbytes} bytes) in the host tier: {e}"), resolved)
            return False

    def _start_initial_store(self, rec, req, tier, resolved):
        if tier == "host":
            if not self._alloc_host(rec, req, resolved):
                return
            tag = next(self._tags)
            self._inflight[tag] = (TransferKind.D2H, rec, req)
            self.backend.start_copy(TransferKind.D2H, rec.host_block, rec.initial, rec.nbytes, tag)
        else:
            tag = next(self._tags)
            self._inflight[tag] = (TransferKind.STORE, rec, req)
            self.backend.start_store(rec.name, rec.initial, rec.nbytes, b"", tag, snapshot=False)

    def _reserve(self, nbytes, *, demand, incoming=None):
        """A device block for nbytes, None to wait, or BudgetError if it can never fit."""
        be = self.backend
        need = be.block_bytes(nbytes)
        if need > self._high:
            raise BudgetError(f"{nbytes} bytes can never fit: the high watermark is {self._high} bytes "
                              f"(device budget {self.config.device_budget})")
        pinned = sum(be.block_bytes(r.nbytes) for r in self._records.values() if r.pins and r.block)
        if pinned + need > self._high:
            raise BudgetError(f"{nbytes} bytes cannot fit: {pinned} bytes are pinned and the high "
                              f"watermark is {self._high} bytes")
        if be.device_used() + need > self._high and not self._make_room(need, demand=demand, incoming=incoming):
            return None
        # Where the framework tensor still points (if anywhere): landing there again
        # saves a rebind, which in MindSpore waits (spinning a core) for the whole
        # op queue to drain.
        prefer = incoming.bound_address if incoming is not None and incoming.bound_address else None
        while True:
            try:
                block = be.alloc_device(nbytes, prefer)
                break
            except _native.OutOfSpace:
                # Enough bytes under the watermark but no contiguous run:
                # evict one more victim by policy and try again.
                if not self._evict_one(demand, incoming):
                    return None
        used = be.device_used()
        for check in self._reserve_checks:
            check(used, self._high)
        assert used <= self._high, (used, self._high)
        self._peak = max(self._peak, used)
        return block

    def _victims(self, demand, incoming):
        """Eviction candidates, best victim first."""
        candidates = [r for r in self._records.values()
                      if r.state is State.RESIDENT and not r.pins and not r.waiters
                      and not r.writeback_failed and (demand or not r.prefetched_unused)]
        ranked = self._policy.rank(candidates)
        if incoming is not None and not demand and self._policy.knows(incoming.name):
            # Belady: never evict a tensor needed sooner than the one being prefetched.
            limit = self._policy.distance(incoming.name)
            ranked = [r for r in ranked if self._policy.distance(r.name) > limit]
        return ranked

    def _make_room(self, need, *, demand, incoming=None):
        """Evict until used + need <= low watermark (hysteresis). True if room now exists."""
        be = self.backend
        goal = min(self._low, self._high - need)
        self._fence_if(lambda: be.device_used() + need > self._high)
        if be.device_used() <= goal:
            return True
        # Blocks already released wait only for a compute fence: count them as free.
        projected = be.device_used() - sum(block.capacity for block, _ in self._unfenced)
        for victim in self._victims(demand, incoming):
            if projected <= goal:
                break
            projected -= be.block_bytes(victim.nbytes)
            self._evict(victim, "watermark")
        self._fence_if(lambda: True)
        return be.device_used() + need <= self._high

    def _evict_one(self, demand, incoming):
        """Free one victim's block now (True), or start its write-back / find none (False)."""
        for victim in self._victims(demand, incoming):
            self._evict(victim, "watermark")
            self._fence_if(lambda: True)
            return victim.state is State.ABSENT
        self._fence_if(lambda: True)
        return False

    def _fence_if(self, condition):
        """Free released device blocks once compute that read them has finished (invariant 4).

        MindSpore runs ops asynchronously even on CPU. A block whose last
        reader was a hooked unit carries that unit's compute-fence epoch: it is
        free as soon as the fence word reaches it. If memory is needed
        (`condition()`) and the epoch is not there yet, the scheduler does not
        block: the fence watcher wakes it when it is, and the reservation waits
        meanwhile. Blocks with no epoch need a whole-queue fence, taken with
        the lock released so the compute thread keeps submitting (only this
        thread changes residency, so the blocks taken are exactly the ones the
        fence covers).
        """
        if not self._unfenced:
            return
        marker = self.backend.marker
        if marker is not None:
            pending = []
            for block, epoch in self._unfenced:
                if epoch is not None and marker.reached(epoch):
                    self.backend.free_device(block)
                else:
                    pending.append((block, epoch))
            self._unfenced = pending
        if not self._unfenced or not condition():
            return
        epochs = [e for _, e in self._unfenced]
        if marker is not None and None not in epochs:
            if self._watcher(marker).want(max(epochs)):
                self.stats.fences += 1   # memory reuse now waits on compute (without blocking)
            return
        entries, self._unfenced = self._unfenced, []
        self._lock.release()
        try:
            self.backend.compute_fence()
        finally:
            self._lock.acquire()
        self.stats.fences += 1
        for block, _ in entries:
            self.backend.free_device(block)

    def _watcher(self, marker):
        if self._fence_watcher is None:
            self._fence_watcher = _FenceWatcher(marker, self.backend.notify, self.name)
        return self._fence_watcher

    def _evict(self, rec, reason):
        """Start dropping rec's device replica; write back first if it is the only copy."""
        if rec.dirty or not (rec.remote_valid or rec.host_valid):
            rec.evict_after_store = reason
            self._start_writeback(rec)
            return
        self._drop(rec, reason)

    def _drop(self, rec, reason):
        assert rec.pins == 0 and rec.state is State.RESIDENT and not rec.dirty
        block, rec.block = rec.block, None
        rec.state = State.ABSENT
        rec.prefetched_unused = False
        if rec.exposed:
            self._unfenced.append((block, rec.compute_epoch))
        else:
            self.backend.free_device(block)
        if rec.bound_address:
            self._guard(rec)   # the framework tensor still views the old block
        rec.exposed = False
        self.stats.evictions[reason] = self.stats.evictions.get(reason, 0) + 1
        self._emit("evicted", rec)

    def _start_writeback(self, rec):
        rec.state = State.STORING
        rec.store_generation = rec.generation
        tag = next(self._tags)
        self._inflight[tag] = (TransferKind.STORE, rec, None)
        self.backend.start_store(rec.name, rec.block, rec.nbytes, b"", tag)

    def _evict_request(self, req, resolved):
        for rec in req.recs:
            if rec.pins:
                self._fail_request(req, PinnedError(
                    f"cannot evict {rec.name!r}: it is pinned ({rec.pins} pin(s)) by compute"), resolved)
                return
        pending = []
        for rec in req.recs:
            if rec.state is State.RESIDENT:
                self._evict(rec, "explicit")
            if rec.state is not State.ABSENT:
                if rec.state is State.LOADING:
                    rec.evict_after_load = True
                pending.append(rec)
        if pending:
            self._waiting_room.append((req, pending))
        else:
            self._fence_if(lambda: True)   # an explicit evict gives the memory back now
            self._resolve(req, None, resolved)

    def _flush_request(self, req, resolved):
        recs = req.recs if req.recs is not None else tuple(self._records.values())
        pending = []
        for rec in recs:
            if rec.state is State.RESIDENT and (rec.dirty or not (rec.remote_valid or rec.host_valid)):
                rec.writeback_failed = False
                self._start_writeback(rec)
            if rec.state is State.STORING:
                pending.append(rec)
        if pending:
            self._waiting_room.append((req, pending))
        else:
            self._resolve(req, None, resolved)

    def _settle_waiting_room(self, resolved):
        still = []
        for req, recs in self._waiting_room:
            failed = next((r for r in recs if r.writeback_failed and r.state is State.RESIDENT), None)
            if failed is not None:
                self._resolve(req, failed.error, resolved)
                continue
            if req.kind == "evict":
                for r in recs:
                    if r.state is State.RESIDENT and not r.pins:
                        self._evict(r, "explicit")
                done = all(r.state is State.ABSENT for r in recs)
                if done:
                    self._fence_if(lambda: True)
            else:
                done = all(r.state is not State.STORING for r in recs)
            if done:
                self._resolve(req, None, resolved)
            else:
                still.append((req, recs))
        self._waiting_room = still

    def _on_completion(self, c, resolved):
        entry = self._inflight.pop(c.tag, None)
        if entry is None:
            return
        kind, rec, req = entry
        seconds = max(0.0, (c.end_ns - c.start_ns) / 1e9)
        if kind in (TransferKind.LOAD, TransferKind.H2D):
            self._loads_in_flight -= 1
            self._load_done(rec, kind, c, seconds, resolved)
        elif kind is TransferKind.STORE:
            self._store_done(rec, req, c, seconds, resolved)
        elif kind is TransferKind.VERIFY:
            self._verify_done(rec, req, c, resolved)
        elif kind is TransferKind.STAGE:
            if c.status:
                self.backend.free_host(rec.host_block)
                rec.host_block = None
                self._fail_request(req, self._transfer_error("read", rec, c), resolved)
            else:
                rec.host_valid = True
                req.remaining -= 1
                if req.remaining == 0:
                    self._resolve(req, None, resolved)
        elif kind is TransferKind.D2H:    # register(tier="host")
            rec.initial = None
            if c.status:
                self.backend.free_host(rec.host_block)
                rec.host_block = None
                self._resolve(req, StorageError(f"staging {rec.name!r} in the host tier: {c.message}"),
                              resolved)
            else:
                rec.host_valid = True
                self.stats.record_transfer("d2h", rec.nbytes, seconds)
                self._resolve(req, None, resolved)

    def _load_done(self, rec, kind, c, seconds, resolved):
        rec.initial = None
        if c.status:
            error = self._transfer_error("read", rec, c)
            self.backend.free_device(rec.block)
            rec.block = None
            rec.state = State.ABSENT
            rec.error = error
            self._emit("failed", rec, seconds, str(error))
            self._fail_waiters(rec, error, resolved)
            return
        registering = any(req.kind == "register" for req in rec.waiters)
        rec.state = State.RESIDENT
        rec.dirty = registering
        rec.error = None
        rec.last_use = next(self._tick)
        rec.prefetched_unused = not any(req.kind in ("pin", "register") for req in rec.waiters)
        self.stats.record_transfer(kind.value if kind is TransferKind.H2D else "load", rec.nbytes, seconds)
        self._emit("loaded", rec, seconds)
        waiters, rec.waiters = rec.waiters, []
        for req in waiters:
            if req.future.done():
                continue
            if req.kind == "pin":
                rec.pins += 1
                req.pinned.append(rec)
                rec.prefetched_unused = False
            req.remaining -= 1
            if req.remaining == 0:
                self._resolve(req, None, resolved)
        if rec.evict_after_load and not rec.pins:
            rec.evict_after_load = False
            self._evict(rec, "explicit")

    def _store_done(self, rec, req, c, seconds, resolved):
        if c.status:
            error = self._transfer_error("write", rec, c)
            rec.error = error
            if req is not None:   # initial store of a register(tier="remote")
                self._resolve(req, error, resolved)
                return
            # The device replica stays, dirty and in place; nothing is lost.
            rec.state = State.RESIDENT
            rec.writeback_failed = True
            rec.evict_after_store = None
            self._emit("failed", rec, seconds, str(error))
            return
        self.stats.record_transfer("store", rec.nbytes, seconds)
        tag = next(self._tags)
        self._inflight[tag] = (TransferKind.VERIFY, rec, req)
        self.backend.start_verify(rec.name, tag)

    def _verify_done(self, rec, req, c, resolved):
        if req is not None:       # register(tier="remote")
            rec.initial = None
            if c.status:
                self._resolve(req, self._transfer_error("verify", rec, c), resolved)
            else:
                rec.remote_valid = True
                self._resolve(req, None, resolved)
            return
        if c.status:
            error = self._transfer_error("verify", rec, c)
            rec.error = error
            rec.state = State.RESIDENT
            rec.writeback_failed = True
            rec.evict_after_store = None
            self._emit("failed", rec, 0.0, str(error))
            return
        self.stats.writebacks += 1
        rec.remote_valid = True
        rec.host_valid = False     # the host replica, if any, is older now
        rec.state = State.RESIDENT
        rec.dirty = rec.generation != rec.store_generation   # written again while storing
        self._emit("written_back", rec)
        reason, rec.evict_after_store = rec.evict_after_store, None
        if reason and not rec.pins:
            if rec.dirty:
                self._evict(rec, reason)
            else:
                self._drop(rec, reason)

    def _transfer_error(self, op, rec, c):
        if c.status == _native.STATUS_CHECKSUM:
            self.stats.checksum_failures += 1
            return IntegrityError(f"{op} of {rec.name!r} failed verification: {c.message}")
        self.stats.io_errors[op if op in ("read", "write") else "read"] += 1
        return StorageError(f"{op} of {rec.name!r} failed: {c.message}")

    def _fail_waiters(self, rec, error, resolved):
        waiters, rec.waiters = rec.waiters, []
        for req in waiters:
            self._fail_request(req, error, resolved)

    def _resolve(self, req, error, resolved):
        resolved.append((req, error))

    def _fail_request(self, req, error, resolved):
        if req.future is None or req.future.done() or any(r is req for r, _ in resolved):
            return
        for rec in req.pinned:
            rec.pins -= 1
        req.pinned.clear()
        for rec in req.recs:
            if req in rec.waiters:
                rec.waiters.remove(req)
        self._count("fetch" if req.kind == "pin" else req.kind, "failed")
        self._resolve(req, error, resolved)

    def _shutdown(self, deadline, resolved):
        """Cancel what has not started; write back dirty replicas while time allows."""
        err = ShutdownError("daemon closed before the request completed")
        while self._loads:
            *_, rec, req = heapq.heappop(self._loads)
            self._fail_waiters(rec, err, resolved)
        while self._inbox:
            req = self._inbox.popleft()
            if req.future is not None:
                self._resolve(req, err, resolved)
        if self.config.store_dir:   # a private temporary store dies with the daemon anyway
            for rec in self._records.values():
                if rec.state is State.RESIDENT and rec.dirty:
                    # One more try also for a write-back that failed before: the
                    # fault may have passed, and this is the last chance.
                    rec.writeback_failed = False
                    self._start_writeback(rec)

    def _finish(self, resolved):
        """Release everything (scheduler thread, after the last transfer settled)."""
        lost = [r.name for r in self._records.values()
                if r.state in (State.RESIDENT, State.STORING) and r.dirty and self.config.store_dir]
        if lost:
            log.error("prefetchd %s closed with %d dirty tensor(s) not written back: %s",
                      self.name, len(lost), ", ".join(lost[:10]))
        for req, _ in self._waiting_room:
            self._resolve(req, ShutdownError("daemon closed before the request completed"), resolved)
        self._waiting_room.clear()
        for rec in self._records.values():
            # Resident tensors keep viewing their block: the native arena stays
            # mapped while any view of it lives. Absent ones stay guarded.
            if rec.target is not None and rec.state is State.RESIDENT:
                guard.release(rec.target)
            rec.block = None
            rec.host_block = None
        self._unfenced.clear()
        if self._fence_watcher is not None:
            self._fence_watcher.stop()
        self.backend.close()


class _FenceWatcher:
    """A thread that sleeps on the compute-fence word and wakes the scheduler.

    The scheduler never blocks on compute it does not have to: when it needs
    memory that a unit still computing holds, it asks for that unit's epoch
    here and goes on serving requests; this thread wakes it when the epoch is
    reached (futex wait, GIL released).
    """

    def __init__(self, marker, notify, name):
        self._marker, self._notify = marker, notify
        self._cond = threading.Condition()
        self._target = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name=f"prefetchd-fence-{name}", daemon=True)
        self._thread.start()

    def want(self, epoch):
        """Wake the scheduler once the fence word reaches epoch; True if that is a new target."""
        with self._cond:
            if epoch > self._target:
                self._target = epoch
                self._cond.notify()
                return True
            return False

    def stop(self):
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(5.0)

    def _run(self):
        reached = 0
        while True:
            with self._cond:
                while not self._stopped and self._target <= reached:
                    self._cond.wait()
                if self._stopped:
                    return
                target = self._target
            # Bounded waits so stop() is prompt; each wake re-checks the target.
            now = self._marker.wait(target, 0.2)
            if now >= target:
                reached = now
                self._notify()


class _StoreWriter:
    """Adapts a backend to staging.stage_tensors' store interface."""

    def __init__(self, backend):
        self.backend = backend

    def write_sync(self, key, data, nbytes, meta):
        self.backend.write_sync(key, data, meta)


def _settle(daemon, req, error):
    """Resolve a request's future outside the lock (callbacks may call back in)."""
    try:
        if error is None:
            req.future.set_result(None)
        else:
            req.future.set_exception(error)
    except InvalidStateError:    # cancelled by its caller meanwhile
        if req.pinned:
            daemon.unpin(req.pinned)


def _scheduler_loop(daemon_ref):
    """The scheduler thread. Holds only a weak reference between iterations."""
    daemon = daemon_ref()
    backend = daemon.backend
    shutdown_deadline = None
    del daemon
    while True:
        timeout = None if shutdown_deadline is None else max(0.0, shutdown_deadline - time.monotonic())
        completions = backend.wait_completions(0.5 if timeout is None else min(timeout, 0.05))
        daemon = daemon_ref()
        if daemon is None:
            return
        resolved = []
        with daemon._lock:
            try:
                for c in completions:
                    daemon._on_completion(c, resolved)
                while daemon._inbox:
                    req = daemon._inbox.popleft()
                    if req.kind == "shutdown":
                        shutdown_deadline = req.args
                        daemon._shutdown(shutdown_deadline, resolved)
                        break
                    try:
                        daemon._handle(req, resolved)
                    except Exception as e:   # refuse this request, keep serving the rest
                        log.exception("prefetchd: %s request failed", req.kind)
                        if req.future is not None:
                            daemon._fail_request(req, PrefetchdError(f"{req.kind} failed: {e!r}"), resolved)
                daemon._fence_if(lambda: False)     # free what finished compute since last time
                if shutdown_deadline is None:
                    daemon._pump_loads(resolved)
                    daemon._settle_waiting_room(resolved)
                else:
                    daemon._settle_waiting_room(resolved)
            except Exception as e:  # never leave callers hanging on a scheduler bug
                log.exception("prefetchd scheduler error")
                for req in list(daemon._inbox):
                    if req.future is not None:
                        resolved.append((req, PrefetchdError(f"scheduler error: {e!r}")))
                daemon._inbox.clear()
            stop = shutdown_deadline is not None and (
                not daemon._inflight or time.monotonic() >= shutdown_deadline)
            if stop:
                daemon._finish(resolved)
        for req, error in resolved:
            _settle(daemon, req, error)
        del daemon
        if stop:
            return
