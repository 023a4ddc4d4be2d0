"""What prefetchd reports about itself.

    stats            counters and histograms the scheduler keeps (no I/O)
    timeline         the Chrome/Perfetto trace recorder
    timeline_report  reading a trace back: spans, breakdowns, summaries, plots
    metrics          the Prometheus collector over a daemon's status and stats
    metrics_server   the bounded HTTP exporter
"""
