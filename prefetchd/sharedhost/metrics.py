"""Prometheus families of a shared host tier, from its owner's status()."""


def families(status):
    """Gauges and counters of `status` (SharedHostOwner.status()); [] for None."""
    if not status:
        return []
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def gauge(name, doc, value):
        fam = GaugeMetricFamily(f"prefetchd_shared_host_{name}", doc)
        fam.add_metric([], value)
        return fam

    def counter(name, doc, key):
        fam = CounterMetricFamily(f"prefetchd_shared_host_{name}", doc)
        fam.add_metric([], status["counters"].get(key, 0))
        return fam

    leases = GaugeMetricFamily("prefetchd_shared_host_leases",
                               "Shared blocks each attached process holds (mapped or in flight).",
                               labels=["pid", "name"])
    hits = CounterMetricFamily("prefetchd_shared_host_worker_hits",
                               "Acquires of each attached process served by a block already filled.",
                               labels=["pid", "name"])
    for w in status["workers"]:
        leases.add_metric([str(w["pid"]), w["name"]], w["leases"])
        hits.add_metric([str(w["pid"]), w["name"]], w["hits"])
    return [gauge("bytes", "Bytes of shared host blocks (page-rounded).", status["bytes"]),
            gauge("budget_bytes", "Budget of the shared host tier.", status["budget"]),
            gauge("blocks", "Filled shared host blocks.", status["blocks"]),
            counter("hits", "Acquires served by a block already filled.", "hits"),
            counter("fills", "Blocks filled from the store (one disk read each).", "fills"),
            counter("fill_bytes", "Bytes read from the store into shared blocks.", "fill_bytes"),
            counter("evictions", "Unleased blocks dropped for room.", "evictions"),
            leases, hits]
