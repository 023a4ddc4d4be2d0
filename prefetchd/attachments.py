"""The daemon's optional attachments: the metrics exporter and the control-plane server.

The composition root (prefetchd/daemon.py) builds them from the Config; the
scheduler core never imports either.
"""
import logging
import time

from .errors import ConfigError

log = logging.getLogger("prefetchd")


class Attachments:
    """What the composition root adds around the core: the metrics exporter and the
    control-plane server (the core never imports either)."""

    def __init__(self):
        self.exporter = None
        self.server = None

    @property
    def metrics_port(self):
        return self.exporter.port if self.exporter else None

    def export_metrics(self, daemon, addr, port):
        from .telemetry.metrics import start_exporter
        self.exporter = start_exporter(daemon, addr, port)

    def serve(self, daemon, endpoint, **kwargs):
        from .control.server import Server
        if self.server is not None and not self.server.closed:
            # A second server replacing the first left it answering after close(), with
            # its thread, descriptors and socket files: one endpoint per daemon (a closed
            # one may be replaced).
            raise ConfigError(f"prefetchd {daemon.config.name}: already serving at "
                              f"{self.server.endpoint}; a daemon has one control endpoint")
        self.server = Server(daemon, endpoint, **kwargs).start()
        return self.server

    def close(self, deadline, name):
        stops = []
        if self.server is not None:
            stops.append(lambda: self.server.close(max(0.1, (deadline - time.monotonic()) / 2)))
        if self.exporter is not None:
            stops.append(self.exporter.close)
        for stop in stops:
            try:
                stop()
            except Exception:   # keep closing: the scheduler and memory matter more
                log.exception("prefetchd %s: stopping an attachment failed", name)
