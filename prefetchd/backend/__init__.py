"""Backends: where the device tier lives and how bytes move between tiers.

`cpu` runs everywhere on the native engine (the arena is the device tier);
`ascend` builds the same moves from MindSpore's unified-addressing operators.
"""
from .base import Backend, Completion, TransferKind


def create(config):
    if config.backend == "cpu":
        from .cpu import CpuBackend
        return CpuBackend(config)
    if config.backend == "ascend":
        from .ascend import AscendBackend
        return AscendBackend(config)
    raise ValueError(f"unknown backend {config.backend!r}")


__all__ = ["Backend", "Completion", "TransferKind", "create"]
