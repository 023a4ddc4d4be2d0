"""`prefetchd serve`: a multi-process inference server with dynamic batching and prefetch hints.

    spec         ServeSpec, model factories (--model module:function), worker Configs
    servable     what a worker serves: signatures (TensorSpec), servables, ServedModel
    causal_lm    the servable of an HF-style causal LM (generate); tiny_lm: a small one
    wire         tensors as frames after the JSON header, checked before use
    admission    a request's tensors against the model's signature; its batch key
    batching     per-model queues joined into batches; Job, Batch
    worker       the worker process: a Daemon, its control Server, the offloaded models
    execute      a worker runs one batch: join, forward or generate, split
    pool         worker processes and which one takes the next batch
    heartbeat    hung workers found and replaced
    front        the front's op table (infer, generate, status, ping) and routing
    front_sockets the front's lifecycle and sockets
    deadlines    requests' deadlines
    status       the status op: the front's and every worker's status
    histograms   batch size and queue time per model; metrics: the Prometheus collector
    client       Client: numpy in, numpy out, futures
"""
from .client import Client
from .front import Front
from .tensor_spec import TensorSpec
from .spec import ServeSpec, worker_config

__all__ = ["Client", "Front", "ServeSpec", "TensorSpec", "worker_config"]
