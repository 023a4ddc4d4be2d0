"""Transitional alias of prefetchd.control (the control plane moved there).

Kept only until prefetchd.daemon, prefetchd.bench.soak and prefetchd/__init__.py
import prefetchd.control; new code imports prefetchd.control.
"""
from .control import (BusyError, Client, RequestTimeout, Server, ServiceError, Subscription,
                      create_keys, default_endpoint, resolve_endpoint, runtime_dir)

__all__ = ["Server", "Client", "Subscription", "ServiceError", "BusyError", "RequestTimeout",
           "default_endpoint", "resolve_endpoint", "runtime_dir", "create_keys"]
