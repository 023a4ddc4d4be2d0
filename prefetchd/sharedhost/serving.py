"""The shared host tier of `prefetchd serve`: the front owns it, the workers attach.

The owner's store is one more set of hard links to the checkpoint store (like each
worker's store), so the owner reads the very files the workers would, and a
(name, version, crc) a worker asks for is the one its own store holds. Only a
checkpoint store can be shared: without one every worker writes its own weights
into its own store, and nothing says two workers' tensors are the same bytes.
"""
import os
import shutil

from ..config import Config, ConfigError
from .owner import SharedHostOwner


def start_owner(spec, runtime_dir, tag, link_store):
    """(owner, owner store dir) for a front serving `spec`; the socket goes in runtime_dir.
    `link_store(src, dst)` makes dst a store of hard links to src (serve.worker's)."""
    if not spec.checkpoint_store:
        raise ConfigError("--shared-host needs --checkpoint-store: only workers serving one staged "
                          "store hold the same tensors (without one each worker writes its own)")
    budget = Config.load(spec.config_path).host_budget
    if not budget:
        raise ConfigError("--shared-host: the host budget (host_budget) is 0, so nothing could be shared")
    store = os.path.join(spec.store_dir, f"shared-host-{tag}")
    shutil.rmtree(store, ignore_errors=True)
    os.makedirs(spec.store_dir, exist_ok=True)
    try:     # (a link refused, e.g. another filesystem, left the directory behind)
        link_store(spec.checkpoint_store, store)
        return SharedHostOwner(os.path.join(runtime_dir, f"{tag}-host.sock"), store, budget).start(), store
    except BaseException:
        shutil.rmtree(store, ignore_errors=True)
        raise


def stop_owner(owner, store, timeout=10.0):
    owner.close(timeout)
    shutil.rmtree(store, ignore_errors=True)
