"""The ZeroMQ control plane of a daemon (see docs/control-plane.md).

    protocol     wire format and reply codes        codes      reply codes <-> exceptions
    endpoints    ipc/tcp endpoints, private dirs    keys       CURVE certificates
    ioloop       the one-thread socket loop         server     the daemon's Server
    ops          operation table + validators       leases     pin leases
    client       Client and Subscription            stats_codec  Stats <-> JSON
    served       the daemon methods the server uses (typing.Protocol)

This package never imports prefetchd.daemon.
"""
from .client import Client, Subscription
from .codes import BusyError, ConnectionLost, RequestTimeout, ServiceError
from .endpoints import default_endpoint, resolve_endpoint, runtime_dir
from .keys import create_keys
from .server import Server

__all__ = ["Server", "Client", "Subscription", "ServiceError", "BusyError", "RequestTimeout", "ConnectionLost",
           "default_endpoint", "resolve_endpoint", "runtime_dir", "create_keys"]
