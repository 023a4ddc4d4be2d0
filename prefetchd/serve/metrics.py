"""Prometheus metrics of a `prefetchd serve` front: its own prefetchd_serve_*
series (from Front.snapshot()), with per-model histograms of batch size and
queue time (prefetchd_serve_batch_size, prefetchd_serve_queue_seconds), plus
every worker's daemon series, fetched over the workers' control endpoints at
scrape time (one `stats` request each) and merged; the `daemon` label tells
workers apart. A worker that does not answer within a second is left out of that
scrape and shows as prefetchd_serve_worker_up 0."""
import threading

from ..control.client import Client
from ..control.stats_codec import stats_from_json


class FrontCollector:
    def __init__(self, front, timeout=1.0):
        self._front = front
        self._timeout = timeout
        self._clients = {}
        self._lock = threading.Lock()

    def _client(self, endpoint):
        with self._lock:
            if endpoint not in self._clients:
                self._clients[endpoint] = Client(endpoint, timeout=self._timeout)
            return self._clients[endpoint]

    def close(self):
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()

    def _worker_families(self, workers, up):
        merged = {}
        from ..telemetry.metrics import DaemonCollector
        for w in workers:
            doc = None
            if w["ready"]:
                try:
                    doc = self._client(w["control"]).stats()
                except Exception:  # noqa: BLE001 - a scrape reports what it can
                    doc = None
            up.add_metric([str(w["index"])], 1 if doc else 0)
            if not doc:
                continue
            for fam in DaemonCollector.families(doc["status"], stats_from_json(doc["stats"])):
                if fam.name in merged:
                    merged[fam.name].samples.extend(fam.samples)
                else:
                    merged[fam.name] = fam
        return list(merged.values())

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        snap = self._front.snapshot()
        counters = snap["counters"]
        up = GaugeMetricFamily("prefetchd_serve_worker_up",
                               "1 if the worker answered this scrape's stats request.",
                               labels=["worker"])
        workers = self._worker_families(snap["workers"], up)
        requests = CounterMetricFamily("prefetchd_serve_requests",
                                       "Inference requests accepted by the front.")
        requests.add_metric([], counters.get("requests", 0))
        errors = CounterMetricFamily("prefetchd_serve_errors",
                                     "Error replies of the front, by code.", labels=["code"])
        for code, n in sorted(snap["errors"].items()):
            errors.add_metric([code], n)
        hints = CounterMetricFamily("prefetchd_serve_hints",
                                    "Prefetch hints sent to workers, by outcome.", labels=["outcome"])
        for outcome in ("sent", "ok", "failed", "dropped"):
            hints.add_metric([outcome], counters.get(f"hints_{outcome}", 0))
        deaths = CounterMetricFamily("prefetchd_serve_worker_deaths",
                                     "Worker processes that exited unexpectedly.")
        deaths.add_metric([], counters.get("worker_deaths", 0))
        queue = GaugeMetricFamily("prefetchd_serve_queue_depth",
                                  "Requests waiting in the front for a worker.")
        queue.add_metric([], snap["queued"])
        ready = GaugeMetricFamily("prefetchd_serve_workers_ready", "Workers ready to serve.")
        ready.add_metric([], sum(1 for w in snap["workers"] if w["ready"]))
        from ..sharedhost.metrics import families as shared_host_families
        return [requests, errors, hints, deaths, queue, ready, up,
                *histogram_families(snap["histograms"]), *workers,
                *shared_host_families(snap.get("shared_host"))]


# The per-model histograms of Front.snapshot() (prefetchd.serve.histograms) and their series.
HISTOGRAMS = {
    "batch_size": ("prefetchd_serve_batch_size",
                   "Rows per batch the front sent to a worker (one forward or generate), by model."),
    "queue_seconds": ("prefetchd_serve_queue_seconds",
                      "Seconds a request waited before a worker began its batch (in the front's queue, "
                      "then behind the batch the worker was running), by model."),
}


def histogram_families(histograms):
    """Prometheus histogram families of {model: {key: Histogram.snapshot()}}: one series
    per model, every family present (empty) before the first batch."""
    import math

    from prometheus_client.core import HistogramMetricFamily

    families = []
    for key, (name, doc) in HISTOGRAMS.items():
        fam = HistogramMetricFamily(name, doc, labels=["model"])
        for model, hs in sorted(histograms.items()):
            snap = hs.get(key)
            if snap is None:
                continue
            buckets = [("+Inf" if math.isinf(b) else repr(float(b)), n) for b, n in snap["buckets"]]
            fam.add_metric([model], buckets, snap["sum"])
        families.append(fam)
    return families


def start_front_exporter(front, addr="127.0.0.1", port=0):
    """Serve the front's and its workers' metrics on http://addr:port/metrics; the
    returned Exporter's close() also closes the collector's clients."""
    from prometheus_client import CollectorRegistry

    from ..telemetry.metrics_server import serve_registry

    collector = FrontCollector(front)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    # The daemon's bounded server: idle connections cannot exhaust the front's fds.
    return _FrontExporter(serve_registry(registry, addr or "127.0.0.1", int(port), name=front.name),
                          collector)


class _FrontExporter:
    """An Exporter plus the collector whose clients it must close."""

    def __init__(self, exporter, collector):
        self._exporter = exporter
        self._collector = collector
        self.port = exporter.port

    def close(self, timeout=5.0):
        self._exporter.close(timeout)
        self._collector.close()
