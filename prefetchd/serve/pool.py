"""The workers of a front: their processes (spawn), their control sockets, and
which one takes the next request. Used on the front's I/O thread only."""
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import time
from dataclasses import dataclass, field

import zmq

from ..control.protocol import STORAGE
from ..control.server_options import ipc_socket_files
from .worker import remove_worker_store, store_in_use, worker_main, worker_store_path

log = logging.getLogger("prefetchd.serve.pool")

MAX_START_FAILURES = 3          # deaths before READY, in a row, before a slot gives up
# A slot given up tries once more after RETRY_AFTER seconds, then after twice as long each
# time it fails again, at most RETRY_AT_MOST (a cause that passes, a full disk cleaned or a
# model file put back, left the server a worker short until it was restarted).
RETRY_AFTER = 60.0
RETRY_AT_MOST = 600.0


# Each worker is a process with its own MindSpore and daemon: far fewer fit any machine, and a
# typo (99999999) filled the RAM with slots before the first spawn.
MAX_WORKERS = 256


@dataclass
class WorkerSlot:
    index: int
    control: str                   # the worker daemon's control endpoint
    generation: int = 0
    process: object = None
    identity: bytes = b""
    ctl: object = None             # DEALER to the worker's control Server
    ready: bool = False
    pid: int | None = None
    hints: dict = field(default_factory=dict)   # model -> tensor names of its first units
    inflight: dict = field(default_factory=dict)   # batch job id -> prefetchd.serve.batching.Batch
    last_model: str | None = None
    joined: dict = field(default_factory=dict)   # (model, kind) -> its "joined" verdict (parts_for)
    served: int = 0
    failed: int = 0
    storage_streak: int = 0        # its batches in a row whose every request failed STORAGE
    deaths: int = 0
    start_failures: int = 0
    start_error: str | None = None   # why it could not start, from its `failure` pipe
    failure: object = None           # read end of the pipe its start failure comes through
    exit_how: str | None = None      # how its last process ended: "exit 3", "signal 9"
    hung_batches: int | None = None  # killed as hung (replace_hung): its batches, failed then
    spawned_at: float = 0.0
    retry_at: float | None = None    # given up: when it tries once more (WorkerPool.retry_due)
    retries: int = 0                 # of those, since it was last ready

    def count_reply(self, requests, failed_codes):
        """A batch of `requests` answered, those that failed with `failed_codes`: served
        unless every one failed (a worker whose store was gone counted as serving), and
        `storage_streak` (WorkerPool.pick) grows while they all fail STORAGE."""
        every = len(failed_codes) == requests
        self.served, self.failed = self.served + (not every), self.failed + every
        self.storage_streak = self.storage_streak + 1 if every and set(failed_codes) == {STORAGE} else 0

    def parts_for(self, model, kind):
        """The most requests one batch of `kind` for `model` may carry to this worker, by its
        verdict on joining them (prefetchd.serve.execute: a result's "joined"); None: no limit
        but the rows. Until it has checked that the model's joined outputs split into each
        request's own, it runs the requests one after another, and so it does for good once
        the check failed: a full batch of a slow model's requests timed out at its tail while
        each alone was answered in time. Two is the fewest a check compares; one at a time,
        the rest go to other workers."""
        joined = self.joined.get((model, kind))
        return None if joined is True else 1 if joined is False else 2

    def public(self):
        """A JSON-able snapshot (what status and metrics report)."""
        return {"index": self.index, "pid": self.pid, "ready": self.ready,
                # no process and no respawn coming: it failed to start too often (on_death)
                "given_up": self.process is None and self.start_failures >= MAX_START_FAILURES,
                "retry_in": None if self.retry_at is None else max(0.0, self.retry_at - time.monotonic()),
                "retries": self.retries,         # given up: the waits so far (each twice the last)
                "start_error": self.start_error,
                "generation": self.generation, "control": self.control,
                "inflight": len(self.inflight), "served": self.served, "failed": self.failed,
                "deaths": self.deaths, "last_model": self.last_model,
                "storage_failures_in_a_row": self.storage_streak}


# Batches in a row failed STORAGE after which a worker is picked only when the others are full.
STORAGE_STREAK = 3


class WorkerPool:
    """`n` worker slots; `work_endpoint` is the front's ROUTER the workers connect to."""

    def __init__(self, n, control_endpoint, work_endpoint, spec, max_inflight):
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_WORKERS:
            raise ValueError(f"workers: {n!r}: expected a whole number from 1 to {MAX_WORKERS}")
        self.slots = [WorkerSlot(i, control_endpoint(i)) for i in range(n)]
        self.work_endpoint = work_endpoint
        self.spec = spec
        self.max_inflight = max_inflight
        self._mp = multiprocessing.get_context("spawn")
        self._ctx = None

    def start(self, ctx):
        self._ctx = ctx
        for slot in self.slots:
            self.spawn(slot)

    def spawn(self, slot):
        slot.generation += 1
        while self.spec.store_dir and store_in_use(worker_store_path(self.spec, slot.index, slot.generation)):
            slot.generation += 1           # a killed front's worker still holds that one
        slot.ready, slot.pid, slot.last_model, slot.storage_streak = False, None, None, 0
        slot.identity = f"w{slot.index}-{slot.generation}".encode()
        # Why it could not start comes through a pipe, written before it exits: read once it
        # is reaped, it is there (a message on the work socket could arrive after the death).
        slot.failure, failure = self._mp.Pipe(duplex=False)
        slot.process = self._mp.Process(
            target=worker_main, name=f"prefetchd-worker-{slot.index}", daemon=True,
            args=(slot.index, slot.generation, dataclasses.asdict(self.spec), self.work_endpoint,
                  slot.control, os.getpid(), failure))
        slot.process.start()
        failure.close()
        slot.spawned_at = time.monotonic()
        if slot.ctl is not None:
            slot.ctl.close(linger=0)
        slot.ctl = self._ctx.socket(zmq.DEALER)
        slot.ctl.linger = 0
        slot.ctl.connect(slot.control)

    def by_identity(self, identity):
        return next((s for s in self.slots if s.identity == identity), None)

    def on_ready(self, slot, info):
        slot.ready, slot.pid, slot.start_failures, slot.retries = True, info["pid"], 0, 0
        slot.start_error, slot.joined = None, {}     # a new process checks its joins afresh
        slot.hints = {name: doc.get("hints", []) for name, doc in info.get("models", {}).items()}
        log.info("prefetchd serve: worker %d ready (pid %d)", slot.index, slot.pid)

    def settled(self):
        """Whether every worker is ready or given up (start is over: serve with the ready ones)."""
        return all(s.ready or s.process is None for s in self.slots)

    def has_room(self):
        """Whether some ready worker can take another batch now."""
        return any(s.ready and len(s.inflight) < self.max_inflight for s in self.slots)

    def pick(self, model):
        """The ready worker with the fewest requests in flight, preferring one whose
        last model is `model`; None if all are full. A worker whose store keeps failing
        (STORAGE_STREAK batches in a row failed STORAGE: its store directory removed, its
        disk gone) goes last: it answers at once, so it had the fewest in flight and took
        every request while a healthy worker idled. A success puts it back."""
        best, best_key = None, None
        for s in self.slots:
            if not s.ready or len(s.inflight) >= self.max_inflight:
                continue
            key = (s.storage_streak >= STORAGE_STREAK, len(s.inflight), s.last_model != model, s.index)
            if best_key is None or key < best_key:
                best, best_key = s, key
        return best

    def on_death(self, slot, respawn):
        """Account for a dead worker; returns (reason, its in-flight batches). Removes its
        store, then respawns it unless `respawn` is false or it failed to start too often."""
        slot.process.join(1.0)        # the sentinel fires just before the child is reapable
        code = slot.process.exitcode
        hung, slot.hung_batches = slot.hung_batches, None
        if not slot.ready and hung is None:      # a worker killed as hung had started
            slot.start_failures += 1
        how = slot.exit_how = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
        failure = _failure_of(slot)              # read (and closed) whether it was ready or not
        slot.start_error = None if slot.ready or hung is not None else failure
        pid = slot.process.pid
        reason = f"worker {slot.index} (pid {pid}) died ({how}) while serving the request"
        jobs = list(slot.inflight.values())
        if hung is not None:
            log.warning("prefetchd serve: worker %d (pid %s), killed as hung, ended (%s); its %d batches "
                        "failed when it was replaced", slot.index, pid, how, hung)
        elif slot.ready or slot.start_error is None:
            log.warning("prefetchd serve: worker %d (pid %s) died (%s); %d batches failed",
                        slot.index, pid, how, len(jobs))
        else:          # said once, by the front's error, or below once it gives up
            log.info("prefetchd serve: worker %d (pid %s) could not start (attempt %d of %d): %s",
                     slot.index, pid, slot.start_failures, MAX_START_FAILURES, slot.start_error)
        if code is not None:           # reaped: nothing uses its store or sockets any more
            self._remove_leftovers(slot)
        slot.inflight.clear()
        slot.deaths += 1
        if respawn and slot.start_failures < MAX_START_FAILURES:
            self.spawn(slot)
            return reason, jobs
        slot.process, slot.ready = None, False
        if respawn:
            wait = min(RETRY_AFTER * 2 ** slot.retries, RETRY_AT_MOST)
            slot.retry_at, slot.retries = time.monotonic() + wait, slot.retries + 1
            if not self.none_alive():     # else the front stops, saying why
                log.error("prefetchd serve: worker %d failed to start %s; giving up, trying once more "
                          "in %.0fs (%s)", slot.index, "again" if slot.retries > 1 else
                          f"{MAX_START_FAILURES} times in a row", wait, slot.start_error or "see its log above")
        return reason, jobs

    def retry_due(self, now):
        """Start once more each given-up slot whose retry_at has come: one failure gives it
        up again (on_death), for twice as long."""
        for slot in self.slots:
            if slot.retry_at is not None and slot.retry_at <= now:
                slot.retry_at, slot.start_failures = None, MAX_START_FAILURES - 1
                log.info("prefetchd serve: worker %d: trying to start it again", slot.index)
                self.spawn(slot)

    def next_retry(self):
        return min((s.retry_at for s in self.slots if s.retry_at is not None), default=None)

    def take_inflight(self):
        """Every slot's in-flight batches, taken (the front is closing: it answers them)."""
        batches = [b for s in self.slots for b in s.inflight.values()]
        for s in self.slots:
            s.inflight.clear()
        return batches

    def replace_hung(self, slot):
        """A worker that stopped answering: no more work for it, and SIGKILL (its sentinel then
        fires, and on_death respawns it). Returns its in-flight batches, which fail now."""
        slot.ready = False
        batches = list(slot.inflight.values())
        slot.inflight.clear()
        slot.hung_batches = len(batches)
        try:
            os.kill(slot.pid, signal.SIGKILL)
        except (ProcessLookupError, TypeError):
            pass
        return batches

    def none_alive(self):
        return all(s.process is None for s in self.slots)

    def close_sockets(self):
        for s in self.slots:
            if s.ctl is not None:
                s.ctl.close(linger=0)
                s.ctl = None

    def stop(self, deadline):
        """Wait for the ready workers (they got STOP), then SIGTERM, then SIGKILL, by `deadline`.
        One still starting got no STOP, and nothing it built is worth waiting for: SIGTERM
        at once (it exits at once: worker._exit_on_sigterm)."""
        procs = [s.process for s in self.slots if s.process is not None]
        for s in self.slots:
            if s.process is not None and not s.ready and s.process.is_alive():
                _terminate(s.process)
        grace = time.monotonic() + min(3.0, max(0.0, deadline - time.monotonic()) / 2)
        for p in procs:
            p.join(max(0.0, grace - time.monotonic()))
        for p in procs:
            if p.is_alive():
                _terminate(p)              # the worker closes its daemon and exits
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        for s in self.slots:
            _failure_of(s)                      # closes its pipe
            if s.process is not None and not s.process.is_alive():
                self._remove_leftovers(s)
        return procs

    def _remove_leftovers(self, slot):
        """An exited worker's store, and the socket files of its control Server: one that
        exits before it is ready (SIGTERM while building, os._exit) cannot remove them."""
        remove_worker_store(self.spec, slot.index, slot.generation)
        for path in ipc_socket_files(slot.control):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def _terminate(process):
    """SIGTERM, then SIGCONT: a stopped worker (SIGSTOP, a debugger let go) handles the
    SIGTERM only once continued; without it, it sat out the whole deadline and was killed,
    its daemon unclosed."""
    process.terminate()
    with contextlib.suppress(ProcessLookupError):
        os.kill(process.pid, signal.SIGCONT)


def _failure_of(slot):
    """The reason a worker that never got ready wrote to its pipe before it exited, or None."""
    pipe, slot.failure = slot.failure, None
    if pipe is None:
        return None
    try:
        return str(pipe.recv())[:2000] if pipe.poll() else None
    except (EOFError, OSError):
        return None
    finally:
        pipe.close()
