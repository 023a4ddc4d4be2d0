"""Prometheus metrics for one Daemon: a custom collector and an HTTP exporter.

Each daemon gets its own `CollectorRegistry` holding one `DaemonCollector`, and
every sample carries a `daemon` label (the daemon's name), so several daemons in
one process never collide and their series stay apart once scraped.

Nothing here runs on the scheduler's hot path. At scrape time the collector
calls `daemon.snapshot()` once -- one consistent copy of the status dict and the
`Stats` counters, taken under the daemon's lock -- and turns that copy into
metric families outside the lock. The scheduler only bumps plain integers and
histogram slots (see `prefetchd.stats`); no per-request Python objects are kept.

Names follow the Prometheus conventions: prefix `prefetchd_`, base units (bytes,
seconds), ratios 0..1 ending in `_ratio`, counters exposed with `_total`,
histograms rather than summaries, no unbounded labels (never a tensor name).

    exporter = start_exporter(daemon, "127.0.0.1", 0)   # port 0: pick a free port
    exporter.port, exporter.url                          # what was actually bound
    exporter.close()                                     # stop serving, join the thread
    render(daemon)                                       # exposition text, for tests and the CLI

Transfer time is the `prefetchd_transfer_duration_seconds` histogram's `_sum`
(there is no separate seconds counter: it would be the same number twice).
The registry also carries the standard `process_*` metrics (CPU seconds, RSS,
open and max file descriptors) of the process the daemon runs in.

The exporter is `MetricsServer`: one thread, a selector loop, a cap on open
connections and a deadline per connection, so idle or slow clients cannot use
up file descriptors or threads and lock the scraper out.
"""
import collections
import gzip
import importlib.metadata
import ipaddress
import logging
import selectors
import socket
import sys
import threading
import time
import weakref
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from . import __version__

__all__ = ["DaemonCollector", "Exporter", "MetricsServer", "make_registry", "render", "serve_registry",
           "start_exporter", "build_info"]

log = logging.getLogger("prefetchd.metrics")

# name -> (type, help, label names besides `daemon`). The one list both
# `describe()` and the dashboard/alert authors read; `collect()` fills it in.
METRICS = {
    # Device tier (the budgeted compute tier).
    "prefetchd_device_memory_used_bytes": (
        "gauge", "Bytes reserved on the device tier (resident + loading).", ("device",)),
    "prefetchd_device_memory_capacity_bytes": (
        "gauge", "Device tier budget in bytes.", ("device",)),
    "prefetchd_device_memory_peak_bytes": (
        "gauge", "Highest device tier reservation since the daemon started, in bytes.", ("device",)),
    "prefetchd_device_memory_watermark_bytes": (
        "gauge", "Device tier watermarks in bytes: reservations never exceed level=high; "
                 "eviction stops at level=low.", ("device", "level")),
    "prefetchd_device_memory_usage_ratio": (
        "gauge", "Device tier bytes used divided by capacity (0..1).", ("device",)),
    # Host and remote tiers.
    "prefetchd_host_memory_used_bytes": (
        "gauge", "Bytes of host staging memory in use.", ()),
    "prefetchd_host_memory_budget_bytes": (
        "gauge", "Host staging memory budget in bytes.", ()),
    "prefetchd_remote_stored_bytes": (
        "gauge", "Bytes held by the remote tier (file store).", ()),
    # Scheduler state.
    "prefetchd_queue_depth": (
        "gauge", "Requests waiting in the scheduler queue.", ()),
    "prefetchd_transfers_in_flight": (
        "gauge", "Transfers issued to the copy streams and not yet completed.", ()),
    "prefetchd_pinned_tensors": (
        "gauge", "Tensors pinned by compute (never evicted or moved while pinned).", ()),
    "prefetchd_pinned_bytes": (
        "gauge", "Bytes of pinned tensors.", ()),
    "prefetchd_tensors": (
        "gauge", "Managed tensors by the state of their device replica.", ("state",)),
    # Transfers.
    "prefetchd_transfer_bytes": (
        "counter", "Bytes moved, by direction (load: remote->device, store: device->remote, "
                   "h2d: host->device, d2h: device->host).", ("direction",)),
    "prefetchd_transfer_size_bytes": (
        "histogram", "Size of each transfer in bytes, by direction.", ("direction",)),
    "prefetchd_transfer_duration_seconds": (
        "histogram", "Duration of each transfer in seconds, by direction (_sum: total seconds "
                     "spent transferring).", ("direction",)),
    # Requests and scheduling.
    "prefetchd_requests": (
        "counter", "Requests by operation and outcome.", ("op", "outcome")),
    "prefetchd_evictions": (
        "counter", "Device replicas dropped, by reason.", ("reason",)),
    "prefetchd_queue_wait_seconds": (
        "histogram", "Time a request waited in the queue before the scheduler took it.", ()),
    "prefetchd_stall_seconds": (
        "histogram", "Time compute waited for a tensor that was not resident yet.", ()),
    "prefetchd_trace_resyncs": (
        "counter", "Times the recorded execution order changed and was re-synchronised.", ()),
    "prefetchd_writebacks": (
        "counter", "Dirty device replicas written back to the remote tier and verified.", ()),
    "prefetchd_fences": (
        "counter", "Compute fences waited on before device memory was reused.", ()),
    # Errors.
    "prefetchd_checksum_failures": (
        "counter", "Reads from the remote tier whose checksum did not match (data refused).", ()),
    "prefetchd_io_errors": (
        "counter", "Failed remote tier I/O operations, by op.", ("op",)),
    # Info.
    "prefetchd_io_engine_info": (
        "gauge", "The remote tier I/O engine in use (value is always 1).", ("engine",)),
    "prefetchd_build_info": (
        "gauge", "prefetchd build information (value is always 1).",
        ("version", "mindspore_version", "native")),
}

_FAMILIES = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily,
             "histogram": HistogramMetricFamily}

_build_info = None


def build_info():
    """{"version", "mindspore_version", "native"}: read once, without importing MindSpore."""
    global _build_info
    if _build_info is None:
        try:
            ms = importlib.metadata.version("mindspore")
        except importlib.metadata.PackageNotFoundError:
            ms = "none"
        native = "none"
        try:
            from . import _native
            native = str(_native.build_info().get("version", "unknown"))
        except Exception:  # not built (source checkout) or an older engine: say so, never fail a scrape
            native = "none" if "prefetchd._native" not in sys.modules else "unknown"
        _build_info = {"version": __version__, "mindspore_version": ms, "native": native}
    return _build_info


def _family(name, extra_labels=()):
    kind, doc, labels = METRICS[name]
    return _FAMILIES[kind](name, doc, labels=("daemon", *labels, *extra_labels))


def _buckets(hist):
    """Stats.Histogram -> [(le, cumulative count)] as HistogramMetricFamily wants them."""
    return [(floatToGoString(bound), count) for bound, count in hist.cumulative()]


class DaemonCollector(Collector):
    """Turns one `daemon.snapshot()` per scrape into the `METRICS` families."""

    def __init__(self, daemon):
        try:
            self._daemon = weakref.ref(daemon)
        except TypeError:  # an object without weakref support: hold it strongly
            self._daemon = lambda: daemon

    def describe(self):
        return [_family(name) for name in METRICS]

    def collect(self):
        daemon = self._daemon()
        if daemon is None:  # the daemon was garbage-collected without close(): nothing to report
            return []
        status, stats = daemon.snapshot()
        return self.families(status, stats)

    @staticmethod
    def families(status, stats):
        name = str(status.get("name", "default"))
        dev = status["device"]
        device = str(status.get("backend", "cpu"))
        fams = {n: _family(n) for n in METRICS}

        def add(metric, value, *labels):
            fams[metric].add_metric([name, *labels], value)

        add("prefetchd_device_memory_used_bytes", dev["used"], device)
        add("prefetchd_device_memory_capacity_bytes", dev["capacity"], device)
        add("prefetchd_device_memory_peak_bytes", dev["peak"], device)
        add("prefetchd_device_memory_watermark_bytes", dev["high_watermark"], device, "high")
        add("prefetchd_device_memory_watermark_bytes", dev["low_watermark"], device, "low")
        ratio = dev.get("usage_ratio")
        if ratio is None:
            ratio = dev["used"] / dev["capacity"] if dev["capacity"] else 0.0
        add("prefetchd_device_memory_usage_ratio", ratio, device)
        add("prefetchd_host_memory_used_bytes", status["host"]["used"])
        add("prefetchd_host_memory_budget_bytes", status["host"]["budget"])
        add("prefetchd_remote_stored_bytes", status["remote"]["bytes"])
        add("prefetchd_queue_depth", status["queue_depth"])
        add("prefetchd_transfers_in_flight", status["in_flight"])
        add("prefetchd_pinned_tensors", status["pinned"])
        add("prefetchd_pinned_bytes", status["pinned_bytes"])
        for state, n in sorted(status["states"].items()):
            add("prefetchd_tensors", n, state)

        for direction in sorted(stats.transfer_bytes):
            add("prefetchd_transfer_bytes", stats.transfer_bytes[direction], direction)
        for metric, hists in (("prefetchd_transfer_size_bytes", stats.transfer_size),
                              ("prefetchd_transfer_duration_seconds", stats.transfer_duration)):
            for direction in sorted(hists):
                fams[metric].add_metric([name, direction], _buckets(hists[direction]),
                                        hists[direction].sum)
        for (op, outcome), n in sorted(stats.requests.items()):
            add("prefetchd_requests", n, op, outcome)
        for reason, n in sorted(stats.evictions.items()):
            add("prefetchd_evictions", n, reason)
        fams["prefetchd_queue_wait_seconds"].add_metric([name], _buckets(stats.queue_wait),
                                                        stats.queue_wait.sum)
        fams["prefetchd_stall_seconds"].add_metric([name], _buckets(stats.stall), stats.stall.sum)
        add("prefetchd_trace_resyncs", stats.trace_resyncs)
        add("prefetchd_writebacks", stats.writebacks)
        add("prefetchd_fences", stats.fences)
        add("prefetchd_checksum_failures", stats.checksum_failures)
        for op, n in sorted(stats.io_errors.items()):
            add("prefetchd_io_errors", n, op)

        add("prefetchd_io_engine_info", 1, str(status.get("io_engine") or "unknown"))
        info = build_info()
        add("prefetchd_build_info", 1, info["version"], info["mindspore_version"], info["native"])
        return list(fams.values())


def make_registry(daemon, process=True):
    """A fresh registry holding `daemon`'s collector (and, with `process`, the process_* metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(daemon))
    if process:
        ProcessCollector(registry=registry)
    return registry


def render(daemon):
    """The exposition text a scrape of `daemon` would return right now."""
    return generate_latest(make_registry(daemon)).decode("utf-8")


class _Connection:
    __slots__ = ("sock", "inbox", "outbox", "deadline")

    def __init__(self, sock, deadline):
        self.sock, self.inbox, self.outbox, self.deadline = sock, bytearray(), None, deadline


class MetricsServer:
    """Serves one registry over HTTP from one thread (a selector loop).

    Bounded: at most `max_connections` accepted sockets -- to admit a new one
    at the cap, the oldest connection still waiting for its request is closed,
    so a flood of idle connections never locks out a scrape -- and each
    connection gets `timeout` seconds to send its request and again to take
    the response. One response per connection (`Connection: close`). GET/HEAD
    of /metrics (or /); content negotiation (OpenMetrics) and gzip as
    prometheus_client does. Same surface as socketserver for `Exporter`:
    `server_address`, `serve_forever()`, `shutdown()`, `server_close()`.
    """

    MAX_REQUEST = 16 << 10   # bytes of request line + headers

    def __init__(self, registry, addr="127.0.0.1", port=0, *, max_connections=64, timeout=10.0):
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.registry, self.max_connections, self.timeout = registry, int(max_connections), float(timeout)
        family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                       flags=socket.AI_PASSIVE)[0]
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind(sockaddr)
            self._listener.listen(128)
        except OSError:
            self._listener.close()
            raise
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._conns = collections.OrderedDict()   # socket -> _Connection, oldest first
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self.scrapes = 0
        self.evicted = 0

    def serve_forever(self):
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                wait = min((c.deadline for c in self._conns.values()), default=now + 1.0) - now
                for key, events in self._selector.select(max(0.0, min(wait, 1.0))):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is self._wake_r:
                        self._wake_r.recv(64)
                    elif key.fileobj in self._conns:
                        self._service(self._conns[key.fileobj], events)
                self._expire(time.monotonic())
        finally:
            self._stopped.set()

    def shutdown(self):
        """Stop the loop and wait until it has left (the thread may then be joined)."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._stopped.wait(5.0)

    def server_close(self):
        """Close every socket (after shutdown())."""
        for sock in list(self._conns):
            self._drop(sock)
        for sock in (self._listener, self._wake_r, self._wake_w):
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        self._selector.close()

    # ------------------------------------------------------------ connections
    def _accept(self):
        for _ in range(64):   # a batch per wake-up; the rest on the next turn of the loop
            try:
                sock, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:   # EMFILE/ENFILE: make room, try again on the next turn
                log.warning("metrics exporter: accept failed (%s); closing the oldest idle connection", e)
                if not self._evict_one():
                    time.sleep(0.05)
                return
            if len(self._conns) >= self.max_connections:
                self._evict_one()
            sock.setblocking(False)
            self._conns[sock] = _Connection(sock, time.monotonic() + self.timeout)
            self._selector.register(sock, selectors.EVENT_READ)

    def _evict_one(self):
        """Close the oldest connection still waiting for its request (else the oldest)."""
        victim = next((s for s, c in self._conns.items() if c.outbox is None), None)
        victim = victim if victim is not None else next(iter(self._conns), None)
        if victim is None:
            return False
        self._drop(victim)
        self.evicted += 1
        return True

    def _expire(self, now):
        for sock in [s for s, c in self._conns.items() if c.deadline <= now]:
            self._drop(sock)

    def _drop(self, sock):
        self._conns.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _service(self, conn, events):
        try:
            if conn.outbox is None:
                data = conn.sock.recv(8192)
                if not data:
                    self._drop(conn.sock)
                    return
                conn.inbox += data
                end = conn.inbox.find(b"\r\n\r\n")
                if end < 0:
                    if len(conn.inbox) > self.MAX_REQUEST:
                        self._reply(conn, 431, "text/plain", b"request header too large\n")
                    return
                self._respond(conn, bytes(conn.inbox[:end]))
            else:
                sent = conn.sock.send(conn.outbox)
                conn.outbox = conn.outbox[sent:]
                if not conn.outbox:
                    self._drop(conn.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn.sock)

    def _respond(self, conn, head):
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split()
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return self._reply(conn, 400, "text/plain", b"bad request line\n")
        method, target = parts[0], urlsplit(parts[1]).path
        if method not in ("GET", "HEAD"):
            return self._reply(conn, 405, "text/plain", b"only GET and HEAD\n")
        if target not in ("/metrics", "/"):
            return self._reply(conn, 404, "text/plain", b"not found: try /metrics\n")
        try:
            encoder, content_type = choose_encoder(headers.get("accept", ""))
            body = encoder(self.registry)
        except Exception as e:  # noqa: BLE001 - a failed collection is a 500, not a dead exporter
            log.exception("metrics exporter: collecting failed")
            return self._reply(conn, 500, "text/plain", f"collecting metrics failed: {e}\n".encode())
        self.scrapes += 1
        gzipped = "gzip" in headers.get("accept-encoding", "")
        self._reply(conn, 200, content_type, gzip.compress(body) if gzipped else body,
                    gzipped=gzipped, head_only=method == "HEAD")

    def _reply(self, conn, status, content_type, body, gzipped=False, head_only=False):
        reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
                  431: "Request Header Fields Too Large", 500: "Internal Server Error"}[status]
        head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n"
                + ("Content-Encoding: gzip\r\n" if gzipped else "") + "\r\n").encode("latin-1")
        conn.outbox = memoryview(head + (b"" if head_only else body))
        conn.deadline = time.monotonic() + self.timeout
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)
        self._service(conn, selectors.EVENT_WRITE)   # most responses fit the socket buffer at once


class Exporter:
    """A running HTTP exporter; `close()` stops it and joins its thread (idempotent)."""

    def __init__(self, registry, server, thread):
        self.registry = registry
        self._server = server
        self._thread = thread
        self.addr, self.port = server.server_address[:2]
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        self.url = f"http://{host}:{self.port}/metrics"
        self.closed = False

    def close(self, timeout=5.0):
        if self.closed:
            return
        self.closed = True
        self._server.shutdown()      # returns once serve_forever has left its loop
        self._server.server_close()  # frees the port
        self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<Exporter {self.url}{' closed' if self.closed else ''}>"


def _is_loopback(host):
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def serve_registry(registry, addr="127.0.0.1", port=0, *, name="", max_connections=64, timeout=10.0):
    """Serve `registry` on http://addr:port/metrics from a daemon thread -> Exporter.

    A bound address that is not loopback is logged at WARNING: the metrics are
    readable by anyone who can reach it.
    """
    server = MetricsServer(registry, addr or "127.0.0.1", int(port), max_connections=max_connections,
                           timeout=timeout)
    thread = threading.Thread(target=server.serve_forever, daemon=True,
                              name=f"prefetchd-metrics-{name or server.server_address[1]}")
    thread.start()
    exporter = Exporter(registry, server, thread)
    if not _is_loopback(exporter.addr):
        log.warning("metrics exporter listening on %s (address %r), which is NOT loopback: anyone who can "
                    "reach it can read these metrics; bind 127.0.0.1 unless that is intended",
                    exporter.url, addr)
    return exporter


def start_exporter(daemon, addr="127.0.0.1", port=0, **limits):
    """Serve `daemon`'s metrics on http://addr:port/metrics from a daemon thread.

    `port=0` binds a free port; `Exporter.port` is the one actually bound.
    Binds loopback unless told otherwise. `limits`: max_connections, timeout.
    """
    return serve_registry(make_registry(daemon), addr, port, name=getattr(daemon, "name", "") or "",
                          **limits)
