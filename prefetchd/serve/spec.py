"""What `prefetchd serve` workers build: ServeSpec (plain values: it crosses the
spawn boundary), the model factories, and each worker daemon's Config.

A model factory is "module:function". The function is called once per weight set
as factory(seed=SEED) and returns what prefetchd.serve.servable makes a Servable
of: (cell, signature), a servable object, or a generate-capable causal LM. The
default factory builds the demo model (prefetchd.demo.model), signature
[((batch, seq, hidden), "float32")]: any batch, that seq and hidden.

With a checkpoint store (`checkpoint_store`, a directory made by `prefetchd
stage`) the factory's parameters are not its own: it is called inside
MindSpore's `no_init_parameters()` (so a large model's weights never need to
exist in RAM), and every parameter is served from the store under its own
name, which must match the checkpoint's. One weight set, m0, is served then.
"""
import dataclasses
import importlib
import os
import tempfile
from dataclasses import dataclass

from ..config import BOUNDS, ENV_PREFIX, Config
from ..errors import ConfigError
from .wire import DEFAULT_MAX_TENSOR_BYTES

DEMO_FACTORY = "prefetchd.serve.spec:demo_model"
# --max-request-bytes: a worker's memory grows with the rows of the largest forward it ran
# (MindSpore's pool keeps its peak), so an operator bounds it here, from a page up.
MAX_REQUEST_BYTES_RANGE = (4096, 4 << 30)

# The options of `prefetchd serve` and their defaults: the keys its [serve] table may set.
SERVE_OPTIONS = {"endpoint": None, "workers": 2, "models": None, "hidden": 256, "layers": 4,
                 "batch": 4, "seq": 16, "budget": None, "lookahead": 2, "store": None,
                 "hints": True, "request_timeout": 30.0, "metrics_port": None,
                 "metrics_addr": "127.0.0.1", "model": None, "model_bytes": None,
                 "checkpoint_store": None, "max_batch_size": 8, "max_queue_delay_ms": 2.0,
                 "heartbeat_timeout": 15.0, "start_timeout": 180.0, "shared_host": False,
                 "max_request_bytes": DEFAULT_MAX_TENSOR_BYTES}


@dataclass
class ServeSpec:
    """What each worker builds."""

    models: int = 2            # weight sets m0..m{models-1}
    hidden: int = 256          # demo model width
    layers: int = 4            # demo model blocks
    heads: int | None = None
    batch: int = 4
    seq: int = 16
    budget: float | int | None = None  # device budget of a worker: a float is in units of
                                 # one model's bytes (1.5 = 150%), an int is bytes;
                                 # None: the configured device_budget, else 1.5 models
    lookahead: int = 2         # units the hooks prefetch ahead; also units a hint covers
    tier: str = "remote"
    store_dir: str | None = None  # root; worker k uses <root>/worker-<k>-<generation>
    seed: int = 0
    log_level: str = "WARNING"
    config_path: str | None = None  # prefetchd TOML file for the workers' daemons
    model: str = DEMO_FACTORY  # "module:function" returning a servable (prefetchd.serve.servable)
    model_bytes_hint: int | None = None  # bytes of one weight set of a custom model (for budget)
    checkpoint_store: str | None = None  # a `prefetchd stage` store the weights are served from
    checkpoint_generation: int | None = None  # its generation when the front started (set by it):
                                 # a worker started later links only that one
    max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES  # a request's tensors, in all (and its
                                 # reply's, per tensor): --max-request-bytes
    shared_host: bool = False  # one host tier for all workers, owned by the front (prefetchd.sharedhost)
    shared_socket: str | None = None  # its socket, set by the front for the workers

    def __post_init__(self):
        if self.checkpoint_store and self.models != 1:
            raise ConfigError(f"--checkpoint-store serves the one weight set the store holds; "
                              f"--models {self.models} would need {self.models} (use --models 1)")

    def with_configured_store(self):
        """This spec, its store_dir from the prefetchd config (file, env) if it has none."""
        if self.store_dir is not None:
            return self
        configured = Config.load(self.config_path).store_dir
        return dataclasses.replace(self, store_dir=configured) if configured else self

    def with_temporary_store(self):
        """This spec with a new temporary store_dir (the caller removes it). Beside a
        checkpoint store: worker stores hard-link its files, so same filesystem."""
        near = (os.path.dirname(os.path.realpath(self.checkpoint_store))
                if self.checkpoint_store else None)
        return dataclasses.replace(self, store_dir=tempfile.mkdtemp(
            prefix=".prefetchd-serve-" if near else "prefetchd-serve-", dir=near))

    def model_names(self):
        return [f"m{i}" for i in range(self.models)]

    def is_demo(self):
        return self.model == DEMO_FACTORY

    def model_bytes(self):
        if self.model_bytes_hint:
            return self.model_bytes_hint
        if self.checkpoint_store:
            return sum(t["nbytes"] for t in checkpoint_tensors(self.checkpoint_store).values())
        from ..demo.model import estimate_bytes
        return estimate_bytes(self.hidden, self.layers)

    def budget_in_bytes(self):
        """Whether `budget` is a size (else a share of model_bytes(), or None: the default)."""
        return isinstance(self.budget, int) and not isinstance(self.budget, bool)

    def device_budget(self):
        if self.budget_in_bytes():
            return self.budget
        fraction = 1.5 if self.budget is None else self.budget
        floor = BOUNDS["device_budget"][0]   # (a tiny model's 150% was refused as under it)
        if self.is_demo():   # at least lookahead + 2 blocks, so a forward pass can progress
            from ..demo.model import block_params
            floor = (self.lookahead + 2) * block_params(self.hidden) * 4
        return max(int(self.model_bytes() * fraction), floor)


def load_factory(path):
    """The callable named by "module:function"; ConfigError naming what is missing."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--model {path!r}: expected module:function (e.g. mypkg.models:build)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--model {path!r}: cannot import {module_name}: {e}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"--model {path!r}: {module_name} has no callable {attr!r}")
    return factory


def checkpoint_tensors(path):
    """{name: {shape, dtype, nbytes}} of a store made by `prefetchd stage` (its index);
    ConfigError saying why `path` is not one."""
    from ..staging import INDEX_FILE, read_index
    if not os.path.isdir(path):
        raise ConfigError(f"--checkpoint-store {path}: not a directory (make one with "
                          f"`prefetchd stage CKPT --store {path}`)")
    tensors = read_index(path).get("tensors")
    if not isinstance(tensors, dict) or not tensors:
        raise ConfigError(f"--checkpoint-store {path}: no {INDEX_FILE} listing tensors, so not a "
                          f"store made by `prefetchd stage` (or it holds nothing)")
    return tensors


def check_checkpoint_store(spec, store_root=None):
    """Refuse a checkpoint store the workers could not link their stores to: worker
    stores are hard links to its files (no copy), in `store_root` (None: a temporary
    directory beside the checkpoint store, made by the front)."""
    checkpoint_tensors(spec.checkpoint_store)
    if store_root is None:
        return
    src, root = os.path.realpath(spec.checkpoint_store), os.path.realpath(store_root)
    if os.path.commonpath([src, root]) in (src, root):
        raise ConfigError(f"--checkpoint-store {spec.checkpoint_store} and --store {store_root}: one "
                          f"is inside the other; worker stores are rebuilt under --store, so keep "
                          f"them apart")
    if os.path.isdir(root) and os.stat(src).st_dev != os.stat(root).st_dev:
        raise ConfigError(f"--store {store_root} is on another filesystem than --checkpoint-store "
                          f"{spec.checkpoint_store}: worker stores are hard links to the checkpoint's "
                          f"files (no copy); put --store on the same filesystem")


def build_weight_set(spec, seed):
    """The Servable of one weight set (prefetchd.serve.servable), checked."""
    factory = load_factory(spec.model)
    kwargs = {"spec": spec} if spec.is_demo() else {}
    if spec.checkpoint_store:
        # The store holds the weights: the factory's own would be allocated for nothing.
        from mindspore.nn.utils import no_init_parameters
        with no_init_parameters():
            made = factory(seed=seed, **kwargs)
    else:
        made = factory(seed=seed, **kwargs)
    from .servable import as_servable
    return as_servable(made, spec.model)


def sized(spec):
    """(spec, its first weight set or None). A custom model's default budget is a share of
    one weight set, which only building it can tell: without --model-bytes or a staged
    store the demo model's size stood in (a 32 MiB model was refused a 19 MiB budget).
    Builds the first weight set when it must; the worker offloads that one."""
    if spec.is_demo() or spec.model_bytes_hint or spec.checkpoint_store or spec.budget_in_bytes():
        return spec, None
    from ..backend import block_bytes_for
    first = build_weight_set(spec, spec.seed)
    # As the device tier counts them: each weight a block of the backend's (whole pages on
    # cpu, 2 MiB granules on ascend-vmm): many small tensors take more than their bytes,
    # and 150% of the bytes alone did not hold them.
    block_bytes = block_bytes_for(Config.load(spec.config_path).backend)
    nbytes = sum(block_bytes(int(p.nbytes)) for p in first.cell.get_parameters())
    return dataclasses.replace(spec, model_bytes_hint=max(nbytes, 1)), first


def demo_model(seed=0, spec=None):
    """The default factory: prefetchd.demo.model's demo model at the spec's size."""
    from ..demo.model import build_model
    spec = spec or ServeSpec()
    cell = build_model(hidden=spec.hidden, layers=spec.layers, heads=spec.heads, seed=seed,
                       materialize=not spec.checkpoint_store)
    return cell, [((spec.batch, spec.seq, spec.hidden), "float32")]


def load_section(path, section):
    """The [section] table of a TOML file ({} if absent): Config.load_section, the one TOML reader."""
    return Config.load_section(path, section)


def _configured(path, key):
    """Whether `key` is set by the config file or the environment (not just defaulted)."""
    if ENV_PREFIX + key.upper() in os.environ:
        return True
    path = path or os.environ.get(ENV_PREFIX + "CONFIG")
    if not path:
        return False
    try:
        return key in load_section(path, "prefetchd")
    except ConfigError:
        return False                  # Config.load reports it properly


def worker_config(spec, index, store):
    """The Config of worker `index`'s daemon: the prefetchd config (file, env) with a
    store of its own, LRU (several models share one daemon, so no single trace
    describes its future), and no endpoint or metrics port of its own: the front
    owns the public endpoint and exports the workers' metrics."""
    overrides = {"store_dir": store, "name": f"worker-{index}", "policy": "lru",
                 "shared_host": spec.shared_socket}
    if spec.budget is not None or not _configured(spec.config_path, "device_budget"):
        overrides["device_budget"] = spec.device_budget()
    return Config.load(spec.config_path, **overrides).replace(endpoint=None, metrics_port=None)
