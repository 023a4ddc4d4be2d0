"""Timeline: what compute, the copy streams, the disk and the scheduler did, as a Chrome trace.

    tl = Timeline.from_config("run.json")     # or env PREFETCHD_TRACE; None -> NullTimeline
    tl.transfer("load", name, nbytes, c.start_ns, c.end_ns)   # on a completion
    tl.eviction(name, nbytes, "watermark")                    # on an eviction
    tl.stall(label, started_ns)                               # after compute waited for weights
    tl.compute_begin(unit); ...; tl.compute_end(unit, marker, epoch)   # around a unit
    tl.close()                                # writes run.json (once)

Reading a trace back (spans, breakdown, summarize, plot) is timeline_report's.

The recorder is a fixed-capacity ring (`collections.deque(maxlen=...)`) of
plain tuples: appending is one allocation, thread-safe under the GIL, and the
oldest events fall off a long run instead of growing memory. Nothing is
formatted until `write()`. `NullTimeline` has the same methods doing nothing,
so call sites need no `if tracing:`.

Clock: every timestamp is CLOCK_MONOTONIC nanoseconds -- `time.monotonic_ns()`
on Linux, and the clock the native engine stamps completions with
(`now_ns()` in native/include/common.h) -- so native start_ns/end_ns go in
unconverted.

The file is the Chrome trace JSON object format (`{"traceEvents": [...]}`),
loadable in https://ui.perfetto.dev and chrome://tracing: one process, one
named thread per track (`TRACKS`), "X" spans, "i" instants, "C" counters,
bytes and tensor/unit names in `args`.
"""
import collections
import json
import os
import queue
import threading
import time

from ..errors import ConfigError
from .output_files import output_file_problem, write_atomically

__all__ = ["Timeline", "NullTimeline", "TRACKS", "KIND_TRACKS"]

COMPUTE, LOAD_STREAM, STORE_STREAM = "compute", "load copy stream", "store copy stream"
DISK_READS, DISK_WRITES, SCHEDULER = "disk reads", "disk writes", "scheduler"
TRACKS = (COMPUTE, LOAD_STREAM, STORE_STREAM, DISK_READS, DISK_WRITES, SCHEDULER)
_TRACK_ID = {t: i for i, t in enumerate(TRACKS)}

# A completed transfer occupies its copy stream and, when it touches the
# store, the disk: one span on each track it held (backend/cpu.py puts loads,
# stages and host->device copies on the load stream; stores, verifies and
# device->host copies on the store stream).
KIND_TRACKS = {
    "load": (LOAD_STREAM, DISK_READS),     # remote -> device
    "stage": (LOAD_STREAM, DISK_READS),    # remote -> host
    "h2d": (LOAD_STREAM,),                 # host -> device
    "store": (STORE_STREAM, DISK_WRITES),  # device -> remote (write-back)
    "verify": (STORE_STREAM, DISK_READS),  # read-back proving a write-back durable
    "d2h": (STORE_STREAM,),                # device -> host
}
COPY_TRACKS = (LOAD_STREAM, STORE_STREAM)
DEFAULT_CAPACITY = 200_000   # events; ~40 MB of tuples at most
ENV_VAR = "PREFETCHD_TRACE"
# How long after close() the fence observer still waits for compute to reach a
# fence before it drops that unit's span (compute that never ran has no end).
_FENCE_GRACE_S = 2.0

# Event tuples: (phase, track id, name, ts_ns, dur_ns or counter value, args or None)


class NullTimeline:
    """Tracing off: every method is a no-op (cost: one bound-method call)."""

    enabled = False
    path = None

    def span(self, track, name, start_ns, end_ns, **args): pass
    def instant(self, track, name, ts_ns=None, **args): pass
    def counter(self, track, name, ts_ns, value): pass
    def transfer(self, kind, name, nbytes, start_ns, end_ns, ok=True): pass
    def eviction(self, name, nbytes, reason): pass
    def decision(self, what, name, nbytes=0, **args): pass
    def stall(self, label, start_ns, end_ns=None, **args): pass
    def device_bytes(self, used, ts_ns=None): pass
    def compute_begin(self, unit): pass
    def compute_end(self, unit, marker=None, epoch=None): pass
    def write(self, path=None): return None
    def close(self): return None
    def __len__(self): return 0


class Timeline(NullTimeline):
    """A bounded in-memory recorder; `write()` dumps it as a Chrome trace.

    path: where `close()` writes (None: keep in memory only, e.g. for `summarize`).
    capacity: events kept; older ones are dropped and counted (`dropped`).
    """

    enabled = True

    def __init__(self, path=None, capacity=DEFAULT_CAPACITY, name="prefetchd"):
        if int(capacity) < 1:
            raise ValueError(f"Timeline capacity must be >= 1 event, got {capacity!r}")
        self.path = os.fspath(path) if path is not None else None
        self.name = name
        self.capacity = int(capacity)
        self.origin_ns = time.monotonic_ns()
        self._events = collections.deque(maxlen=self.capacity)
        self._recorded = 0                   # events ever added (approximate across threads)
        self._open_compute = {}              # unit -> start_ns (compute_begin without end yet)
        self._last_compute_end = 0
        self._fences = None                  # queue to the fence observer, started on first use
        self._observer = None
        self._closing = False
        self._written = False
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, trace=None, *, capacity=None, environ=None):
        """The recorder a daemon should use.

        trace: a path (str/PathLike) to write at close; True to record in memory
        only; an existing Timeline/NullTimeline (returned as is); None/False:
        $PREFETCHD_TRACE if set (a path), else a NullTimeline.
        """
        if isinstance(trace, NullTimeline):
            return trace
        if trace is None:
            trace = (os.environ if environ is None else environ).get(ENV_VAR) or None
        if trace is None or trace is False:
            return NullTimeline()
        kwargs = {} if capacity is None else {"capacity": capacity}
        if trace is True:
            return cls(None, **kwargs)
        if not isinstance(trace, (str, os.PathLike)):
            raise TypeError(f"trace: expected a file path, True or a Timeline, got {type(trace).__name__}")
        problem = output_file_problem(trace)     # refused now, not at close() after the whole run
        if problem is not None:
            raise ConfigError(f"trace: {problem}")
        return cls(trace, **kwargs)

    # ------------------------------------------------------------ raw events
    def _add(self, event):
        self._events.append(event)   # atomic under the GIL
        self._recorded += 1          # a diagnostic: a rare lost increment across threads is harmless

    def span(self, track, name, start_ns, end_ns, **args):
        self._add(("X", _TRACK_ID[track], name, start_ns, max(0, end_ns - start_ns), args or None))

    def instant(self, track, name, ts_ns=None, **args):
        self._add(("i", _TRACK_ID[track], name, time.monotonic_ns() if ts_ns is None else ts_ns, 0,
                   args or None))

    def counter(self, track, name, ts_ns, value):
        self._add(("C", _TRACK_ID[track], name, time.monotonic_ns() if ts_ns is None else ts_ns,
                   value, None))

    # ------------------------------------------------------------ what the daemon and hooks call
    def transfer(self, kind, name, nbytes, start_ns, end_ns, ok=True):
        """A completion of TransferKind `kind` (its .value) of tensor `name`: a span on each
        track it occupied (`KIND_TRACKS`). Native completions carry start_ns/end_ns."""
        tracks = KIND_TRACKS.get(kind)
        if tracks is None:
            raise ValueError(f"unknown transfer kind {kind!r} (known: {', '.join(KIND_TRACKS)})")
        args = {"tensor": name, "bytes": nbytes, "kind": kind}
        if not ok:
            args["failed"] = True
        dur = max(0, end_ns - start_ns)
        for track in tracks:
            self._add(("X", _TRACK_ID[track], f"{kind} {name}", start_ns, dur, args))

    def eviction(self, name, nbytes, reason):
        """A device replica dropped (reason: watermark / explicit / shutdown)."""
        self._add(("i", _TRACK_ID[SCHEDULER], f"evict {name}", time.monotonic_ns(), 0,
                   {"tensor": name, "bytes": nbytes, "reason": reason}))

    def decision(self, what, name, nbytes=0, **args):
        """A scheduler decision worth seeing (e.g. "load" issued, "writeback" started)."""
        self._add(("i", _TRACK_ID[SCHEDULER], f"{what} {name}", time.monotonic_ns(), 0,
                   {"tensor": name, "bytes": nbytes, **args}))

    def stall(self, label, start_ns, end_ns=None, **args):
        """Compute waited for weights from start_ns to end_ns (default: now)."""
        end_ns = time.monotonic_ns() if end_ns is None else end_ns
        self._add(("X", _TRACK_ID[SCHEDULER], "stall", start_ns, max(0, end_ns - start_ns),
                   {"waiting_for": label, **args}))

    def device_bytes(self, used, ts_ns=None):
        """Device tier bytes reserved, as a counter track."""
        self.counter(SCHEDULER, "device bytes", ts_ns, used)

    def compute_begin(self, unit):
        """Call at the end of a unit's pre-hook (its weights are bound, its kernels are next)."""
        self._open_compute[unit] = time.monotonic_ns()

    def compute_end(self, unit, marker=None, epoch=None):
        """Call in the unit's post-hook. With a compute fence (`marker`, the `epoch` that
        `marker.mark()` returned) the span ends when MindSpore reaches the fence -- kernels
        run asynchronously after the hook returns -- as stamped by an observer thread that
        sleeps on the fence word; without one it ends now."""
        start = self._open_compute.pop(unit, None)
        if start is None:
            return
        if marker is None or epoch is None:
            self._compute_span(unit, start, time.monotonic_ns(), fenced=False)
            return
        with self._lock:
            if self._closing:     # no observer after close(): end the span now
                fences = None
            else:
                if self._observer is None:
                    self._fences = queue.SimpleQueue()
                    self._observer = threading.Thread(target=self._observe_fences,
                                                      name="prefetchd-timeline-fences", daemon=True)
                    self._observer.start()
                fences = self._fences
        if fences is None:
            self._compute_span(unit, start, time.monotonic_ns(), fenced=False)
        else:
            fences.put((unit, start, marker, epoch))

    def _compute_span(self, unit, start, end, fenced):
        # One executor runs the units in order: a unit's kernels start no
        # earlier than the previous unit's finished, so clamp, and the compute
        # track holds a sequence of non-overlapping spans.
        start = min(max(start, self._last_compute_end), end)
        self._last_compute_end = end
        self._add(("X", _TRACK_ID[COMPUTE], unit, start, end - start, {"unit": unit, "fenced": fenced}))

    def _observe_fences(self):
        while True:
            item = self._fences.get()
            if item is None:
                return
            unit, start, marker, epoch = item
            give_up = None
            while marker.wait(epoch, 0.1) < epoch:
                if self._closing:
                    give_up = give_up or time.monotonic() + _FENCE_GRACE_S
                    if time.monotonic() > give_up:
                        break
            else:
                self._compute_span(unit, start, time.monotonic_ns(), fenced=True)

    # ------------------------------------------------------------ lifecycle and output
    def __len__(self):
        return len(self._events)

    @property
    def dropped(self):
        """Events that fell off the ring (recorded minus kept)."""
        return max(0, self._recorded - len(self._events))

    def events(self):
        """A stable copy of the kept event tuples, oldest first."""
        return list(self._events)

    def close(self):
        """Stop the fence observer (after pending fences, bounded) and write `path` once."""
        with self._lock:
            self._closing = True
            observer, self._observer = self._observer, None
        if observer is not None:
            self._fences.put(None)
            observer.join(_FENCE_GRACE_S + 1.0)
        if self.path and not self._written:
            self.write(self.path)
        return self.path

    def to_json(self):
        """The trace as a dict in the Chrome trace JSON object format."""
        events = self.events()
        origin = min([self.origin_ns, *(e[3] for e in events)])
        pid = os.getpid()
        out = [{"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": self.name}}]
        for tid, track in enumerate(TRACKS):
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid + 1, "args": {"name": track}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid + 1,
                        "args": {"sort_index": tid}})
        for ph, tid, name, ts, extra, args in events:
            e = {"ph": ph, "name": name, "cat": TRACKS[tid], "pid": pid, "tid": tid + 1,
                 "ts": (ts - origin) / 1000.0}
            if ph == "X":
                e["dur"] = extra / 1000.0
            elif ph == "i":
                e["s"] = "t"
            elif ph == "C":
                args = {name: extra}
            if args:
                e["args"] = args
            out.append(e)
        return {"traceEvents": out, "displayTimeUnit": "ms",
                "otherData": {"clock": "CLOCK_MONOTONIC", "origin_ns": origin, "capacity": self.capacity,
                              "events_dropped": self.dropped, "tracks": list(TRACKS)}}

    def write(self, path=None):
        """Write the trace to `path` (default: self.path) atomically; returns the path.
        ValueError if `path` is no regular file or new one in a writable directory."""
        path = os.fspath(path or self.path or "")
        if not path:
            raise ValueError("Timeline.write: no path given and the timeline has none")
        doc = self.to_json()
        write_atomically(path, lambda f: f.write(json.dumps(doc, separators=(",", ":")).encode()))
        if path == self.path:
            self._written = True
        return path
