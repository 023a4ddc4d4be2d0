"""Prometheus metrics for one Daemon: a custom collector and an HTTP exporter.

Each daemon gets its own `CollectorRegistry` holding one `DaemonCollector`, and
every sample carries a `daemon` label (the daemon's name), so several daemons in
one process never collide and their series stay apart once scraped.

Nothing here runs on the scheduler's hot path. At scrape time the collector
calls `daemon.snapshot()` once -- one consistent copy of the status dict and the
`Stats` counters, taken under the daemon's lock -- and turns that copy into
metric families outside the lock. The scheduler only bumps plain integers and
histogram slots (see `prefetchd.telemetry.stats`); no per-request Python objects are kept.

Names follow the Prometheus conventions: prefix `prefetchd_`, base units (bytes,
seconds), ratios 0..1 ending in `_ratio`, counters exposed with `_total`,
histograms rather than summaries, no unbounded labels (never a tensor name).

    exporter = start_exporter(daemon, "127.0.0.1", 0)   # port 0: pick a free port
    exporter.port, exporter.url                          # what was actually bound
    exporter.close()                                     # stop serving, join the thread
    render(daemon)                                       # exposition text, for tests and the CLI

Transfer time is the duration histogram's `_sum` (a seconds counter beside it
would be the same number twice). The registry also carries the standard
`process_*` metrics (CPU, RSS, open/max fds). The exporter (`metrics_server.py`)
bounds connections and their lifetime: idle clients cannot exhaust fds.
"""
import importlib.metadata
import sys
import weakref

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.metrics_core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .. import __version__
from .metrics_server import Exporter, MetricsServer, serve_registry

__all__ = ["DaemonCollector", "Exporter", "MetricsServer", "make_registry", "render", "serve_registry",
           "start_exporter", "build_info"]

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
    "prefetchd_device_loads": (
        "counter", "Loads into the device tier, by the tier they came from (host: the host "
                   "cache in RAM; remote: the store on disk).", ("source",)),
    "prefetchd_device_load_bytes": (
        "counter", "Bytes loaded into the device tier, by the tier they came from.", ("source",)),
    "prefetchd_host_cache_drops": (
        "counter", "Cached host replicas dropped to make room (free: the store holds the data).", ()),
    "prefetchd_fences": (
        "counter", "Compute fences waited on before device memory was reused.", ()),
    "prefetchd_rebinds": (
        "counter", "Framework tensors pointed at new storage after registration (0 with stable "
                   "addresses: residency maps pages under a fixed address).", ()),
    "prefetchd_reclaims": (
        "counter", "Dropped device replicas taken back before their pages left (no I/O).", ()),
    "prefetchd_compute_writes": (
        "counter", "Device replicas found written in place by compute (a kernel, not the Python "
                   "API), so written back before they were dropped.", ()),
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
            from .. import _native
            native = str(_native.build_info().get("version", "unknown"))
        except Exception:  # not built (source checkout) or an older engine: say so, never fail a scrape
            native = "none" if "prefetchd._native" not in sys.modules else "unknown"
        _build_info = {"version": __version__, "mindspore_version": ms, "native": native}
    return _build_info


def _family(name, ranked=False):
    """A family of `name`; a ranked daemon's (one rank of a sharded job) also carries `rank`."""
    kind, doc, labels = METRICS[name]
    return _FAMILIES[kind](name, doc, labels=("daemon", *(("rank",) if ranked else ()), *labels))


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
        rank = status.get("rank")
        # Every sample of a rank's daemon says which rank: the ranks of one job share a
        # daemon name prefix and a dashboard, and are told apart (and summed) by this label.
        base = [str(status.get("name", "default"))] + ([str(rank["rank"])] if rank else [])
        dev = status["device"]
        device = str(status.get("backend", "cpu"))
        fams = {n: _family(n, ranked=bool(rank)) for n in METRICS}

        def add(metric, value, *labels):
            fams[metric].add_metric([*base, *labels], value)

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
                fams[metric].add_metric([*base, direction], _buckets(hists[direction]),
                                        hists[direction].sum)
        for (op, outcome), n in sorted(stats.requests.items()):
            add("prefetchd_requests", n, op, outcome)
        for reason, n in sorted(stats.evictions.items()):
            add("prefetchd_evictions", n, reason)
        fams["prefetchd_queue_wait_seconds"].add_metric(base, _buckets(stats.queue_wait),
                                                        stats.queue_wait.sum)
        fams["prefetchd_stall_seconds"].add_metric(base, _buckets(stats.stall), stats.stall.sum)
        add("prefetchd_trace_resyncs", stats.trace_resyncs)
        add("prefetchd_writebacks", stats.writebacks)
        add("prefetchd_fences", stats.fences)
        add("prefetchd_rebinds", stats.rebinds)
        add("prefetchd_reclaims", stats.reclaims)
        add("prefetchd_compute_writes", getattr(stats, "compute_writes", 0))
        for source in ("host", "remote"):
            add("prefetchd_device_loads", getattr(stats, "loads_from", {}).get(source, 0), source)
            add("prefetchd_device_load_bytes", getattr(stats, "load_bytes_from", {}).get(source, 0), source)
        add("prefetchd_host_cache_drops", getattr(stats, "host_drops", 0))
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


def start_exporter(daemon, addr="127.0.0.1", port=0, **limits):
    """Serve `daemon`'s metrics on http://addr:port/metrics from a daemon thread.

    `port=0` binds a free port; `Exporter.port` is the one actually bound.
    Binds loopback unless told otherwise. `limits`: max_connections, timeout.
    """
    return serve_registry(make_registry(daemon), addr, port, name=getattr(daemon, "name", "") or "",
                          **limits)
