"""Backends: where the device tier lives and how bytes move between tiers.

`cpu` runs everywhere on the native engine (the arena is the device tier);
`ascend` builds the same moves from MindSpore's unified-addressing operators
(rebinding a tensor on each load); `ascend-vmm` keeps stable addresses over
ACL's virtual-memory calls instead.
"""
from .base import Backend, Completion, TransferKind


def create(config):
    try:
        from .. import _native  # noqa: F401  (every backend needs the native engine)
    except ImportError as e:
        from .. import _no_native_engine
        raise ImportError(_no_native_engine()) from e
    if config.backend == "cpu":
        from .cpu import CpuBackend
        return CpuBackend(config)
    if config.backend == "ascend":
        from .ascend import AscendBackend
        return AscendBackend(config)
    if config.backend == "ascend-vmm":
        # Stable addresses over ACL virtual memory (docs/stable-addresses.md); each
        # tensor's home is whole 2 MiB granules, so small tensors cost a granule each.
        from .ascend_vmm import AscendVmmBackend
        return AscendVmmBackend(config)
    raise ValueError(f"unknown backend {config.backend!r}")


def object_argument(backend, overrides):
    """Daemon(backend=...) as an object, or None: a name ("cpu") is the config key of that
    name (moved into `overrides`); a class or anything else is refused."""
    if isinstance(backend, str):
        overrides["backend"] = backend
        return None
    if backend is not None and (isinstance(backend, type) or not callable(getattr(backend, "notify", None))):
        what = f"the class {backend.__name__}" if isinstance(backend, type) else type(backend).__name__
        raise TypeError(f"Daemon(backend=...): a backend object (or a name such as 'cpu'), not {what}")
    return backend


def block_bytes_for(name):
    """Backend `name`'s rule for the bytes a block of n bytes reserves, without making one
    (what a budget for a model of many small tensors must count)."""
    if name == "ascend-vmm":
        from .ascend_vmm import AscendVmmBackend
        return AscendVmmBackend.block_bytes
    from .base import HostAndStoreTiers
    return HostAndStoreTiers.block_bytes


__all__ = ["Backend", "Completion", "TransferKind", "block_bytes_for", "create"]
