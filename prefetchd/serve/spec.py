"""What `prefetchd serve` workers build: ServeSpec (plain values: it crosses the
spawn boundary), the model factories, and each worker daemon's Config.

A model factory is "module:function". The function is called once per weight set
as factory(seed=SEED) and returns (cell, input_spec): a mindspore.nn.Cell and a
list of (shape, dtype name) pairs, one per positional input, e.g.
[((4, 16, 256), "float32")], or (shape, integer dtype, high) for ids drawn from
[0, high). Workers feed it seeded random inputs of that spec.
The default factory builds the demo model (prefetchd.model).
"""
import importlib
import os
from dataclasses import dataclass

from ..config import ENV_PREFIX, Config, ConfigError

DEMO_FACTORY = "prefetchd.serve.spec:demo_model"


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
    model: str = DEMO_FACTORY  # "module:function" returning (cell, input_spec)
    model_bytes_hint: int | None = None  # bytes of one weight set of a custom model (for budget)

    def model_names(self):
        return [f"m{i}" for i in range(self.models)]

    def is_demo(self):
        return self.model == DEMO_FACTORY

    def model_bytes(self):
        if self.model_bytes_hint:
            return self.model_bytes_hint
        from ..model import estimate_bytes
        return estimate_bytes(self.hidden, self.layers)

    def device_budget(self):
        if isinstance(self.budget, int) and not isinstance(self.budget, bool):
            return self.budget
        fraction = 1.5 if self.budget is None else self.budget
        floor = 0
        if self.is_demo():   # at least lookahead + 2 blocks, so a forward pass can progress
            from ..model import block_params
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


def build_weight_set(spec, seed):
    """(cell, input_spec) of one weight set, checked."""
    factory = load_factory(spec.model)
    kwargs = {"spec": spec} if spec.is_demo() else {}
    made = factory(seed=seed, **kwargs)
    if not (isinstance(made, tuple) and len(made) == 2 and isinstance(made[1], (list, tuple))):
        raise ConfigError(f"--model {spec.model}: the factory must return (cell, input_spec), "
                          f"got {type(made).__name__}")
    return made


def demo_model(seed=0, spec=None):
    """The default factory: prefetchd.model's demo model at the spec's size."""
    from ..model import build_model
    spec = spec or ServeSpec()
    cell = build_model(hidden=spec.hidden, layers=spec.layers, heads=spec.heads, seed=seed)
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
    overrides = {"store_dir": store, "name": f"worker-{index}", "policy": "lru"}
    if spec.budget is not None or not _configured(spec.config_path, "device_budget"):
        overrides["device_budget"] = spec.device_budget()
    return Config.load(spec.config_path, **overrides).replace(endpoint=None, metrics_port=None)
