"""prefetchd: keep a MindSpore model's tensors on the right memory tier at the right time.

Importing the package is cheap: MindSpore and the daemon load on first use of
the names below (PEP 562), so `prefetchd --help` and `prefetchd._native` do not
pay for `import mindspore`.
"""
from importlib import import_module

__version__ = "0.1.0"

_LAZY = {
    "Config": "prefetchd.config",
    "Daemon": "prefetchd.daemon",
    "TensorHandle": "prefetchd.handle",
    "offload": "prefetchd.hooks",
    "offloaded": "prefetchd.hooks",
    "load_param_into_net": "prefetchd.hooks",
    "Client": "prefetchd.control",
    "tier": "prefetchd.ops",
    "ops": "prefetchd.ops",
}
_ERRORS = (
    "PrefetchdError", "NotResidentError", "UnknownTensorError", "DoubleRegisterError",
    "BudgetError", "PinnedError", "ShutdownError", "UseAfterFreeError", "DaemonClosedError", "IntegrityError",
    "StorageError", "FlushError", "StagingError", "ConfigError",
)

__all__ = sorted([*_LAZY, *_ERRORS, "__version__"])


def __getattr__(name):
    if name in _ERRORS:
        return getattr(import_module("prefetchd.errors"), name)
    if name in _LAZY:
        try:
            module = import_module(_LAZY[name])
        except ImportError as e:
            if "_native" not in str(e):
                raise
            raise ImportError(_no_native_engine()) from e
        return module if name == "ops" else getattr(module, name)
    raise AttributeError(f"module 'prefetchd' has no attribute {name!r}")


def _no_native_engine():
    import os
    here = os.path.dirname(os.path.abspath(__file__))
    return (f"prefetchd's native engine (_native*.so) is not built in {here}. If that is a source "
            f"checkout shadowing the installed package (python run from the checkout's directory), run "
            f"from another directory; to use the checkout itself, build it in place: pip install -e .")
