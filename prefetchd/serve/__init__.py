"""`prefetchd serve`: a multi-process inference server with prefetch hints.

    spec     ServeSpec, model factories (--model module:function), worker Configs
    worker   the worker process: a Daemon, its control Server, the offloaded models
    pool     worker processes and which one takes the next request
    front    the front's op table (infer, status, ping) and routing
    jobs     requests in flight and their deadlines
    status   the status op: the front's and every worker's status
    metrics  the front's Prometheus collector
"""
from .front import Front
from .spec import ServeSpec, worker_config

__all__ = ["Front", "ServeSpec", "worker_config"]
