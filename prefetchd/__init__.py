"""prefetchd: keep a MindSpore model's tensors on the right memory tier at the right time.

Importing the package is cheap: MindSpore and the daemon load on first use of
the names below (PEP 562), so `prefetchd --help` and `prefetchd._native` do not
pay for `import mindspore`.
"""
from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "Config": "prefetchd.config",
    "ConfigError": "prefetchd.config",
    "Daemon": "prefetchd.daemon",
    "TensorHandle": "prefetchd.handle",
    "offload": "prefetchd.hooks",
    "offloaded": "prefetchd.hooks",
    "Client": "prefetchd.control",
    "tier": "prefetchd.ops",
    "ops": "prefetchd.ops",
}
_ERRORS = (
    "PrefetchdError", "NotResidentError", "UnknownTensorError", "DoubleRegisterError",
    "BudgetError", "PinnedError", "ShutdownError", "UseAfterFreeError", "IntegrityError",
    "StorageError", "StagingError",
)

__all__ = sorted([*_LAZY, *_ERRORS, "__version__"])


def __getattr__(name):
    if name in _ERRORS:
        return getattr(import_module("prefetchd.errors"), name)
    if name in _LAZY:
        module = import_module(_LAZY[name])
        return module if name == "ops" else getattr(module, name)
    raise AttributeError(f"module 'prefetchd' has no attribute {name!r}")
