"""The HTTP side of prefetchd's metrics: a bounded exporter for one registry.

`MetricsServer` serves a prometheus_client registry from one thread (a
selector loop) with a cap on open connections and a deadline per connection,
so idle or slow clients can exhaust neither file descriptors nor threads and
never lock the scraper out (prometheus_client's own server keeps a thread and
a socket per connection for as long as the client likes). `serve_registry`
starts one and warns loudly when the address is not loopback.
"""
import collections
import contextlib
import errno
import gzip
import ipaddress
import logging
import selectors
import socket
import threading
import time
from http import HTTPStatus
from urllib.parse import urlsplit

from prometheus_client.exposition import choose_encoder

__all__ = ["Exporter", "MetricsServer", "check_listenable", "listener", "serve_registry"]

log = logging.getLogger("prefetchd.metrics")


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
        self._listener = listener(addr, port)
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._conns = collections.OrderedDict()   # socket -> _Connection, oldest first
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self.scrapes = self.evicted = 0
        self._accept_failed = False

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
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        self._stopped.wait(5.0)

    def server_close(self):
        """Close every socket (after shutdown())."""
        for sock in list(self._conns):
            self._drop(sock)
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
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
                if not self._accept_failed:
                    self._accept_failed = True   # once: a flood would repeat it for every socket
                    log.warning("metrics exporter: accept failed (%s); closing idle connections", e)
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
        victim = next((s for s, c in self._conns.items() if c.outbox is None), next(iter(self._conns), None))
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
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sock)
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
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
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
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
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


def listener(addr, port):
    """A TCP socket listening on addr:port as the exporter listens; OSError naming the port
    and the setting to change where it cannot."""
    family, _, _, _, sockaddr = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        # The bare "[Errno 98] Address already in use" named neither port nor setting.
        where = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
        fix = ("the metrics_addr setting, or --metrics-addr: an address of this machine"
               if e.errno == errno.EADDRNOTAVAIL else
               "the metrics_port setting, or --metrics-port: choose a free port, or 0 for any free one")
        raise OSError(e.errno, f"metrics exporter: cannot listen on {where}: {e.strerror} ({fix})") from e
    return sock


def check_listenable(addr, port):
    """OSError (as listener's) if the exporter could not listen on addr:port now: checked
    before work that takes long (staging a model, starting workers) and would be lost when
    the exporter fails after it. Port 0 (any free one) always can."""
    if port:
        listener(addr or "127.0.0.1", int(port)).close()


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
