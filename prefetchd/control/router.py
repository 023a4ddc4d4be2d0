"""A ROUTER socket that answers requests: what the daemon's control Server and serve's
Front share.

Both are LoopHandlers on an IOLoop (prefetchd.control.ioloop) answering clients on one
ROUTER: they make and bind sockets (ipc socket files remembered and removed at
teardown), decode a request's header within the size limit, and reply without ever
blocking the loop (a reply the peer cannot take is dropped and counted). What each does
with a decoded request is its own op table. I/O thread only, but for `counters` reads.
"""
import collections

import zmq

from . import keys, protocol as P
from .endpoints import bind, is_ipv6, unlink_ipc_files
from .stats_codec import jsonable


class RouterCounters(collections.Counter):
    """What a ROUTER endpoint counts: events by name, read and bumped either way
    (`counters.busy += 1`, `counters["busy"]`), and `requests` by op, `errors` by code."""

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "requests", collections.Counter())
        object.__setattr__(self, "errors", collections.Counter())

    def __getattr__(self, name):          # only names that are no attribute: events
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def __setattr__(self, name, value):
        self[name] = value


class RouterEndpoint:
    send_copy = True              # False: replies' frames are handed to zmq without a copy

    def __init__(self, max_message_size):
        self.max_message_size = max_message_size
        self.counters = RouterCounters()
        self.on_unroutable = None     # fn(envelope): a reply found its client gone (optional)
        self._router = None
        self._ipc_files = []

    # -- sockets
    @staticmethod
    def _make_socket(ctx, kind, *, hwm=1000, curve=None):
        sock = ctx.socket(kind)
        sock.linger = 0
        sock.sndhwm = sock.rcvhwm = hwm
        if curve is not None:
            keys.make_curve_server(sock, curve)
        return sock

    def _bind(self, sock, address):
        sock.ipv6 = is_ipv6(address)          # tcp://[::1] needs libzmq's IPV6 option
        ipc_file = bind(sock, address)
        if ipc_file is not None:
            self._ipc_files.append(ipc_file)

    def _close_sockets(self, *socks):
        for sock in socks:
            if sock is not None:
                sock.close(linger=0)
        unlink_ipc_files(self._ipc_files)   # libzmq leaves socket files behind
        self._ipc_files.clear()

    # -- requests and replies
    def _decode(self, envelope, head):
        """(rid, op, args, timeout) of a request's header frames, or None once a malformed
        one was answered with its error."""
        try:
            return P.decode_request(head, self.max_message_size)
        except P.ProtocolError as e:
            self.counters.malformed += 1
            self._reply_error(envelope, e.rid, e.code, e.reason)
            return None

    def _send(self, envelope, frames):
        try:
            self._router.send_multipart(envelope + frames, zmq.NOBLOCK, copy=self.send_copy)
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                self.counters.replies_unroutable += 1
                if self.on_unroutable is not None:
                    self.on_unroutable(envelope)
            else:                                   # EAGAIN: the peer's queue is full
                self.counters.replies_dropped += 1
            return False

    def _reply_ok(self, envelope, rid, result):
        try:
            frames = P.encode_ok(rid, result)
        except (TypeError, ValueError):
            frames = P.encode_ok(rid, jsonable(result))
        return self._send(envelope, frames)

    def _reply_error(self, envelope, rid, code, reason):
        self.counters.errors[code] += 1
        return self._send(envelope, P.encode_error(rid, code, reason))
