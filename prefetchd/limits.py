"""How much memory this process can be given, and a budget check against it.

The device arena and the host pool are reserved as address space and faulted
in on first use, so an oversized budget is not refused by mmap: it is refused
by the kernel's OOM killer, much later and with no error message. This module
turns that into a clear error at backend creation.

`available_memory()` takes the smallest of the machine's RAM (MemTotal) and
every memory limit of the process's cgroup and its ancestors (cgroup v2
`memory.max`, cgroup v1 `memory.limit_in_bytes`), and says which one it was.
Swap is not counted: a device tier that swaps is no device tier.
"""
import os
from typing import NamedTuple

from .errors import ConfigError

# cgroup v1 reports "no limit" as a huge page-rounded number, v2 as "max".
_UNLIMITED = 1 << 60


class Available(NamedTuple):
    nbytes: int
    source: str     # e.g. "this machine's RAM (MemTotal in /proc/meminfo)"


def _format(nbytes):
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            value = nbytes / size
            return f"{value:.0f} {unit}" if value == int(value) or value >= 100 else f"{value:.1f} {unit}"
    return f"{nbytes} bytes"


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _mem_total(proc):
    text = _read(os.path.join(proc, "meminfo")) or ""
    for line in text.splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no MemTotal line in {os.path.join(proc, 'meminfo')}")


def _cgroup_paths(proc):
    """{"v2": path} and/or {"v1": path} of this process's memory cgroup."""
    out = {}
    for line in (_read(os.path.join(proc, "self", "cgroup")) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if hier == "0" and controllers == "":
            out["v2"] = path
        elif "memory" in controllers.split(","):
            out["v1"] = path
    return out


def _limits_along(mount, path, filename):
    """(bytes, file) for every numeric limit from the cgroup `path` up to the mount's root."""
    found = []
    rel = path.strip("/")
    while True:
        f = os.path.join(mount, rel, filename) if rel else os.path.join(mount, filename)
        value = (_read(f) or "").strip()
        if value.isdigit() and int(value) < _UNLIMITED:
            found.append((int(value), f))
        if not rel:
            return found
        rel = os.path.dirname(rel)


def available_memory(proc="/proc", cgroup_root="/sys/fs/cgroup"):
    """The bytes this process can be given at most, and where that number comes from."""
    best = Available(_mem_total(proc), f"this machine's RAM (MemTotal in {os.path.join(proc, 'meminfo')})")
    paths = _cgroup_paths(proc)
    candidates = []
    if "v2" in paths:
        # The unified hierarchy is mounted at the root (pure v2) or at unified/ (hybrid).
        for mount in (cgroup_root, os.path.join(cgroup_root, "unified")):
            if os.path.exists(os.path.join(mount, "cgroup.controllers")):
                candidates += [(n, f"this process's cgroup (memory.max: {f})")
                               for n, f in _limits_along(mount, paths["v2"], "memory.max")]
    if "v1" in paths:
        candidates += [(n, f"this process's cgroup (memory.limit_in_bytes: {f})")
                       for n, f in _limits_along(os.path.join(cgroup_root, "memory"), paths["v1"],
                                                 "memory.limit_in_bytes")]
    for nbytes, source in candidates:
        if nbytes < best.nbytes:
            best = Available(nbytes, source)
    return best


def default_host_budget(backend, device_budget):
    """The host budget when none is set: half the memory this machine or its cgroup makes
    available, less the device budget where the device tier is itself host RAM (the cpu
    backend); never negative."""
    half = available_memory().nbytes // 2
    if backend == "cpu":
        half -= device_budget
    return max(0, half)


def check_budgets(device_budget, host_budget, available=None):
    """Raise ConfigError (a ValueError) when device_budget + host_budget exceed what the process can be given.

    The message names both budgets, the limit and where the limit came from.
    """
    available = available or available_memory()
    total = device_budget + host_budget
    if total > available.nbytes:
        raise ConfigError(
            f"device_budget {_format(device_budget)} + host_budget {_format(host_budget)} "
            f"= {_format(total)} exceeds the {_format(available.nbytes)} that {available.source} allows; "
            f"lower the budgets (the kernel would kill the process once the pages are touched)")
    return available


def raise_open_files(need):
    """Raise this process's soft open-file limit to `need` where the hard limit allows (the
    default soft limit, 1024, is far below most hard ones). Returns None, or the limit that
    stays below `need`: the hard one, or the soft one when the kernel refused to raise it
    (the caller refuses, naming what needs them)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return None
    if hard != resource.RLIM_INFINITY and hard < need:
        return hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    except (ValueError, OSError):     # e.g. above fs.nr_open
        return soft
    return None
