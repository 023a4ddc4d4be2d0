"""Sequential I/O benchmark for the remote tier (FileStore) against plain Python reads and fio.

Every method reads the same file in the same run, interleaved repeat by repeat, with the page
cache dropped before each cold read, because this machine's virtual disk drifts a lot between
runs (see docs/performance.md): only numbers from one interleaved run compare.

    python -m prefetchd.bench.io DIR [--size 1G] [--engines auto] [--block-sizes 8M] [--queue-depths 4]
                                     [--repeats 3] [--sweep] [--no-fio] [--no-drop-caches]

MB/s are 10^6 bytes per second.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from prefetchd import _native as native

MiB = 1 << 20
PY_CHUNK = 8 * MiB


def _stats(samples):
    return {"min": round(min(samples), 1), "median": round(statistics.median(samples), 1),
            "max": round(max(samples), 1), "samples": [round(s, 1) for s in samples]}


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def drop_page_cache() -> bool:
    """Drop clean page cache (root only). True if it happened."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _timed(fn, nbytes):
    t0 = time.perf_counter()
    fn()
    return nbytes / (time.perf_counter() - t0) / 1e6


def _python_readinto(path, dst):
    """Buffered unbuffered-object reads (kernel page cache) in 8 MiB chunks into `dst`."""
    mv = memoryview(dst)
    with open(path, "rb", buffering=0) as f:
        off = 0
        while off < len(mv):
            n = f.readinto(mv[off:off + PY_CHUNK])
            if not n:
                break
            off += n
    return off


def fio_read(path: str, size: int, bs: str = "1M", iodepth: int = 8, engine: str = "libaio") -> float | None:
    """MB/s of `fio --direct=1 --rw=read` over the first `size` bytes of `path`; None without fio."""
    exe = shutil.which("fio")
    if not exe:
        return None
    cmd = [exe, "--name=r", f"--filename={path}", "--direct=1", "--rw=read", f"--bs={bs}",
           f"--iodepth={iodepth}", f"--ioengine={engine}", f"--size={size}", "--output-format=json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["read"]["bw_bytes"] / 1e6


def _config_name(c):
    return f"{c['engine']} bs={c['block_size'] // MiB}M qd={c['queue_depth']} thr={c['io_threads']}"


@contextlib.contextmanager
def _opened(directory, c):
    """The FileStore of config `c` on `directory`, closed on exit; records the engine it chose."""
    s = native.FileStore(directory, engine=c["engine"], block_size=c["block_size"],
                         queue_depth=c["queue_depth"], io_threads=c["io_threads"])
    try:
        c["engine_used"], c["direct"] = s.engine, s.direct
        yield s
    finally:
        s.close()


def run(directory: str, size: int = 1 << 30, engines=("auto",), block_sizes=None, queue_depths=None,
        drop_caches: bool = True, repeats: int = 3, io_threads=None, fio_depths=(8, 32),
        python_readers: bool = True, keep_files: bool = False) -> dict:
    """Write a `size`-byte tensor through FileStore, then measure cold sequential reads (native store
    for every engine x block_size x queue_depth, plain Python readinto into an aligned buffer and into
    a naive bytearray, fio libaio 1M at `fio_depths`) interleaved over `repeats` rounds, plus
    FileStore write bandwidth. For the "threads" engine the queue depth is the io_threads count
    (its number of requests in flight) unless io_threads is given."""
    block_sizes = list(block_sizes or [8 * MiB])  # FileStore defaults
    queue_depths = list(queue_depths or [8])
    root = os.path.join(directory, "prefetchd-bench-io")
    os.makedirs(root, exist_ok=True)
    cold = False
    note = ""
    if drop_caches:
        cold = drop_page_cache()
        if not cold:
            note = "page cache not dropped (needs root): reads may be warm"
    else:
        note = "drop_caches=False: reads may be warm"

    configs = []
    for engine in engines:
        for bs in block_sizes:
            for qd in queue_depths:
                thr = io_threads or (qd if engine == "threads" else 4)
                configs.append({"engine": engine, "block_size": bs, "queue_depth": qd, "io_threads": thr})

    src = native.aligned_buffer(size)
    mv = memoryview(src)[:size - size % 8].cast("Q")     # whole words; a tail of < 8 stays 0
    for i in range(0, len(mv), 512):  # cheap non-constant content
        mv[i] = i * 0x9E3779B97F4A7C15 % (1 << 64)
    dst = native.aligned_buffer(size)
    memoryview(dst)[::4096] = b"\0" * len(range(0, size, 4096))  # fault pages in before timing
    naive = bytearray(size)

    path = None
    results = {_config_name(c): {"config": c, "read": [], "write": []} for c in configs}
    store_dir = os.path.join(root, "store")
    try:
        # One FileStore per directory at a time (its lock): each config's store is opened for
        # its own measurement and closed again (open and recovery untimed).
        with _opened(store_dir, configs[0]) as s:
            s.write_sync("bench", src)
            path = s.info("bench")["path"]
        methods = [("store", c) for c in configs]
        if python_readers:
            methods += [("python_readinto_aligned", None), ("python_readinto_bytearray", None)]
        fio_ok = shutil.which("fio") is not None
        if fio_ok:
            methods += [(f"fio_libaio_1M_qd{d}", d) for d in fio_depths]
        extra = {m[0]: [] for m in methods if m[0] != "store"}

        for rep in range(repeats):
            # Rotate the order each round so no method always runs right after another.
            k = rep % len(methods)
            for kind, c in methods[k:] + methods[:k]:
                if kind == "store":
                    with _opened(store_dir, c) as s:
                        if drop_caches:
                            drop_page_cache()
                        results[_config_name(c)]["read"].append(_timed(lambda: s.read_sync("bench", dst), size))
                    continue
                if drop_caches:
                    drop_page_cache()
                if kind == "python_readinto_aligned":
                    extra[kind].append(_timed(lambda: _python_readinto(path, dst), size))
                elif kind == "python_readinto_bytearray":
                    extra[kind].append(_timed(lambda: _python_readinto(path, naive), size))
                else:
                    extra[kind].append(fio_read(path, size, "1M", c))
            # Writes: one new version per config per round (fsync included, as in production).
            for c in configs:
                with _opened(store_dir, c) as s:
                    results[_config_name(c)]["write"].append(_timed(lambda: s.write_sync("bench", src), size))
                    path = s.info("bench")["path"]
    finally:
        if not keep_files:
            shutil.rmtree(root, ignore_errors=True)

    out_rows = []
    for name, r in results.items():
        out_rows.append({"method": "filestore", "name": name, **r["config"], "read_MBps": _stats(r["read"]),
                         "write_MBps": _stats(r["write"])})
    others = {k: _stats(v) for k, v in extra.items() if v}
    buffered = others.get("python_readinto_aligned")
    for row in out_rows:
        if buffered:
            row["ratio_direct_over_buffered"] = round(row["read_MBps"]["median"] / buffered["median"], 2)
        fio8 = others.get("fio_libaio_1M_qd8")
        if fio8:
            row["ratio_over_fio_1M_qd8"] = round(row["read_MBps"]["median"] / fio8["median"], 2)
    best = max(out_rows, key=lambda r: r["read_MBps"]["median"])
    return {
        "directory": directory, "size": size, "repeats": repeats, "cold": cold, "note": note,
        "crc32c": native.crc32c_impl(), "units": "MB/s (10^6 B/s)",
        "filestore": out_rows, "baselines": others,
        "best": {k: best[k] for k in ("name", "engine", "block_size", "queue_depth", "io_threads")},
    }


def sweep(directory: str, size: int = 1 << 30, engines=("aio", "threads"),
          block_sizes=(1 * MiB, 4 * MiB, 8 * MiB, 16 * MiB), queue_depths=(1, 2, 4, 8),
          drop_caches: bool = True, repeats: int = 2, **kw) -> dict:
    """run() over engines x block_sizes x queue_depths in one interleaved run."""
    return run(directory, size=size, engines=engines, block_sizes=block_sizes, queue_depths=queue_depths,
               drop_caches=drop_caches, repeats=repeats, **kw)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m prefetchd.bench.io", description=__doc__.split("\n\n")[0])
    p.add_argument("directory")
    p.add_argument("--size", default="1G")
    p.add_argument("--engines", default=None, help="comma list: auto,aio,threads,buffered")
    p.add_argument("--block-sizes", default=None, help="comma list, e.g. 1M,8M")
    p.add_argument("--queue-depths", default=None, help="comma list, e.g. 2,4,8")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--no-fio", action="store_true")
    p.add_argument("--no-drop-caches", action="store_true")
    a = p.parse_args(argv)
    kw = {"size": _parse_size(a.size), "drop_caches": not a.no_drop_caches}
    if a.engines:
        kw["engines"] = tuple(a.engines.split(","))
    if a.block_sizes:
        kw["block_sizes"] = [_parse_size(x) for x in a.block_sizes.split(",")]
    if a.queue_depths:
        kw["queue_depths"] = [int(x) for x in a.queue_depths.split(",")]
    if a.repeats:
        kw["repeats"] = a.repeats
    if a.no_fio:
        kw["fio_depths"] = ()
    res = (sweep if a.sweep else run)(a.directory, **kw)
    json.dump(res, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
