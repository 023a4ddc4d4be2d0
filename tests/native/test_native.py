"""prefetchd._native: memory (Arena, HostPool, Block), crc32c, streams/events/completion queues."""
import os
import random
import sys
import threading
import time

import numpy as np
import pytest

n = pytest.importorskip("prefetchd._native")


# ---------------------------------------------------------------- helpers

def crc32c_ref(data: bytes, crc: int = 0) -> int:
    """Bitwise reference CRC-32C, independent of the extension."""
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def n_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def n_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ---------------------------------------------------------------- errors

def test_error_hierarchy():
    for name in ("OutOfSpace", "IOFailure", "ChecksumMismatch", "NotFound", "Closed"):
        cls = getattr(n, name)
        assert issubclass(cls, n.NativeError)
    assert issubclass(n.NativeError, RuntimeError)
    assert isinstance(n.status_error(5, "x"), n.IOFailure)
    assert isinstance(n.status_error(n.STATUS_CHECKSUM, "x"), n.ChecksumMismatch)
    assert isinstance(n.status_error(n.STATUS_SHORT_READ, "x"), n.IOFailure)
    assert isinstance(n.status_error(n.STATUS_NOT_FOUND, "x"), n.NotFound)
    assert str(n.status_error(5, "boom")) == "boom"


# ---------------------------------------------------------------- Arena

def test_arena_alloc_alignment_and_rounding():
    a = n.Arena(1 << 20)
    b = a.alloc(5000)
    assert b.nbytes == 5000 and b.capacity == 8192 and b.address % 4096 == 0
    assert b.offset == 0 and len(memoryview(b)) == 5000
    assert a.used == 8192 and a.num_blocks == 1 and a.peak_used == 8192
    c = a.alloc(1)
    assert c.offset == 8192 and c.capacity == 4096
    big = n.Arena(1 << 20, alignment=65536)
    x, y = big.alloc(10), big.alloc(10)
    assert x.address % 65536 == 0 and y.address % 65536 == 0 and y.offset == 65536


def test_arena_first_fit_and_coalescing():
    a = n.Arena(16 * 4096)
    blocks = [a.alloc(4096) for _ in range(16)]
    assert a.largest_free == 0
    with pytest.raises(n.OutOfSpace):
        a.alloc(1)
    # free 3, 4 and 6: holes of 2 and 1 units
    for i in (3, 4, 6):
        blocks[i].release()
    assert a.largest_free == 2 * 4096
    with pytest.raises(n.OutOfSpace, match="largest free"):
        a.alloc(3 * 4096)
    blocks[5].release()  # joins 3..6 into one hole
    assert a.largest_free == 4 * 4096
    b = a.alloc(3 * 4096)
    assert b.offset == 3 * 4096  # first fit: lowest offset
    c = a.alloc(4096)
    assert c.offset == 6 * 4096
    for i, blk in enumerate(blocks):
        if i not in (3, 4, 5, 6):
            blk.release()
    b.release()
    c.release()
    assert a.used == 0 and a.num_blocks == 0 and a.largest_free == a.capacity
    assert a.peak_used == a.capacity


def test_arena_random_alloc_free_keeps_accounting():
    rng = random.Random(7)
    a = n.Arena(256 * 4096)
    live = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            live.pop(rng.randrange(len(live))).release()
        else:
            try:
                live.append(a.alloc(rng.randint(0, 9000)))
            except n.OutOfSpace:
                pass
        assert a.used == sum(b.capacity for b in live)
    spans = sorted((b.offset, b.offset + b.capacity) for b in live if b.capacity)
    for (s0, e0), (s1, _) in zip(spans, spans[1:]):
        assert e0 <= s1  # no overlap
    for b in live:
        b.release()
    assert a.largest_free == a.capacity


def test_arena_zero_length_and_numpy_view():
    a = n.Arena(1 << 20)
    z = a.alloc(0)
    assert z.nbytes == 0 and len(memoryview(z)) == 0
    b = a.alloc(4096 * 3)
    v = np.frombuffer(b, dtype=np.float32)
    assert v.size == 3 * 1024
    assert v.__array_interface__["data"][0] == b.address  # zero copy
    v[:] = 1.5
    w = np.frombuffer(b, dtype=np.float32)
    assert (w == 1.5).all()
    mv = memoryview(b)
    assert mv.format == "B" and not mv.readonly and mv.ndim == 1


def test_arena_close_keeps_outstanding_views_alive():
    a = n.Arena(1 << 20)
    b = a.alloc(4096)
    v = np.frombuffer(b, dtype=np.uint8)
    a.close()
    a.close()  # idempotent
    v[:] = 9  # mapping still alive: no segfault
    assert v.sum() == 9 * 4096
    with pytest.raises(n.Closed):
        a.alloc(1)
    b.release()
    del a
    assert v[0] == 9


def test_arena_out_of_space():
    a = n.Arena(8192)
    with pytest.raises(n.OutOfSpace):
        a.alloc(8193)
    b = a.alloc(8192)
    with pytest.raises(n.OutOfSpace):
        a.alloc(1)
    del b  # a Block dropped without release() still gives its bytes back
    assert a.used == 0
    a.alloc(8192)


# ---------------------------------------------------------------- HostPool and Block

def test_host_pool_exact_budget():
    p = n.HostPool(10_000_000)
    b = p.alloc(5_000_000)
    assert p.used == 5_000_000  # exact, not a power of two
    assert b.address % 4096 == 0 and b.offset == -1 and b.capacity == 5_001_216
    with pytest.raises(n.OutOfSpace):
        p.alloc(5_000_001)
    c = p.alloc(5_000_000)
    assert p.used == 10_000_000 == p.peak_used
    b.release()
    assert p.used == 5_000_000
    c.release()
    assert p.used == 0 and p.peak_used == 10_000_000
    p.close()
    with pytest.raises(n.Closed):
        p.alloc(1)


def test_host_pool_lock_memory_reports():
    p = n.HostPool(1 << 20, lock_memory=True)
    b = p.alloc(1 << 16)
    assert isinstance(p.locked, bool)
    np.frombuffer(b, dtype=np.uint8)[:] = 1
    assert not n.HostPool(1 << 20).locked


def test_block_release_semantics():
    p = n.HostPool(1 << 20)
    b = p.alloc(100)
    v = np.frombuffer(b, dtype=np.uint8)
    v[:] = 3
    b.release()
    assert b.released
    with pytest.raises(n.Closed, match="already released"):
        b.release()
    with pytest.raises(n.Closed):
        memoryview(b)
    with pytest.raises(n.Closed):
        np.frombuffer(b, dtype=np.uint8)
    assert v.sum() == 300  # old view stays mapped
    s = n.Stream()
    try:
        with pytest.raises(n.Closed):
            s.copy(b, b"x")
    finally:
        s.close()


def test_aligned_buffer():
    b = n.aligned_buffer(12345, alignment=8192)
    assert b.address % 8192 == 0 and b.nbytes == 12345 and b.offset == -1
    with pytest.raises(ValueError):
        n.aligned_buffer(10, alignment=3000)


# ---------------------------------------------------------------- crc32c

def test_crc32c_known_vectors():
    assert n.crc32c(b"123456789") == 0xE3069283
    assert n.crc32c(b"") == 0
    assert n.crc32c(bytes(32)) == 0x8A9136AA
    assert n.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert n.crc32c(bytes(range(32))) == 0x46DD794E
    assert n.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert n.crc32c_impl() in ("sse4.2", "table")


def test_crc32c_seed_chaining_and_impl_agreement():
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, size=100_003, dtype=np.uint8).tobytes()
    whole = n.crc32c(data)
    for cut in (0, 1, 7, 4096, 12288, 50_000, len(data)):
        assert n.crc32c(data[cut:], n.crc32c(data[:cut])) == whole
    for size in (0, 1, 3, 8, 15, 4095, 12287, 12288, 12289, 40_000, 100_003):
        for off in (0, 1, 5):
            chunk = memoryview(data)[off:off + size]
            assert n.crc32c(chunk) == n._crc32c_table(chunk), (size, off)
    assert n.crc32c(data[:777]) == crc32c_ref(data[:777])
    assert n.crc32c(np.frombuffer(data[:1000], dtype=np.uint8)) == crc32c_ref(data[:1000])


# ---------------------------------------------------------------- streams and events

def test_stream_fifo_order_within_stream():
    s = n.Stream("fifo")
    try:
        dst = n.aligned_buffer(1 << 20)
        srcs = [bytes([i]) * (1 << 20) for i in range(8)]
        copies, sums = [], []
        for src in srcs:
            copies.append(s.copy(dst, src))
            sums.append(s.checksum(dst))
        s.synchronize()
        assert s.query() and s.pending == 0
        for src, ev in zip(srcs, sums):
            assert ev.result == n.crc32c(src)  # each checksum saw the copy just before it
        evs = [e for pair in zip(copies, sums) for e in pair]
        ends = [e.end_ns for e in evs]
        assert ends == sorted(ends)
        for a, b in zip(evs, evs[1:]):
            assert b.start_ns >= a.end_ns
    finally:
        s.close()


def test_cross_stream_wait_event(tmp_path):
    store = n.FileStore(str(tmp_path), engine="threads")
    a, b = n.Stream("a"), n.Stream("b")
    try:
        data = np.arange(1 << 18, dtype=np.uint32)
        store.write_sync("w", data)
        n.inject_fault("read", "delay", delay_ms=200)  # make stream a's op slow, deterministically
        dst = np.zeros_like(data)
        ev_a = a.read(store, "w", dst)
        b.wait_event(ev_a)
        out = np.zeros_like(data)
        ev_b = b.copy(out, dst)
        assert ev_b.synchronize(timeout=30)
        assert ev_a.query()
        assert ev_b.start_ns >= ev_a.end_ns
        assert (out == data).all()  # b copied what a had read
        assert ev_a.duration >= 0.2
        # Event.wait(stream) is the same thing
        ev_c = a.record()
        ev_c.wait(b)
        ev_d = b.record()
        ev_d.synchronize()
        assert ev_d.end_ns >= ev_c.end_ns
    finally:
        n.clear_faults()
        a.close()
        b.close()
        store.close()


def test_events_from_many_threads():
    shared = n.Stream("shared")
    errors = []
    results = []

    def worker(k):
        try:
            own = n.Stream(f"own{k}")
            src = np.full(1 << 16, k, dtype=np.uint8)
            evs = []
            for i in range(50):
                dst = np.zeros(1 << 16, dtype=np.uint8)
                evs.append((shared.copy(dst, src, tag=k * 1000 + i), dst))
                evs.append((own.checksum(src, tag=i), None))
            for ev, dst in evs:
                assert ev.synchronize(timeout=30)
                if dst is not None:
                    assert (dst == k).all()
            own.close()
            results.append(k)
        except Exception as e:  # surfaced below
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    shared.close()
    assert not errors, errors
    assert sorted(results) == list(range(6))


def test_completion_queue_delivery():
    cq = n.CompletionQueue()
    s = n.Stream()
    try:
        src = np.arange(1000, dtype=np.uint8)
        for i in range(20):
            s.checksum(src, tag=i, cq=cq)
        got = []
        while len(got) < 20:
            got += cq.wait(timeout=30)
        assert sorted(c.tag for c in got) == list(range(20))
        assert all(c.status == 0 and c.result == n.crc32c(src) and c.nbytes == 1000 for c in got)
        assert all(c.end_ns >= c.start_ns for c in got)
        assert cq.pending == 0
        # max_items limits one wait
        for i in range(5):
            s.record(tag=i, cq=cq)
        s.synchronize()
        assert cq.pending == 5
        assert len(cq.wait(max_items=2)) == 2
        assert len(cq.wait(max_items=10)) == 3
    finally:
        s.close()


def test_completion_queue_reports_failures(tmp_path):
    store = n.FileStore(str(tmp_path))
    cq = n.CompletionQueue()
    s = n.Stream()
    try:
        ev = s.read(store, "missing", bytearray(10), tag=7, cq=cq)
        (c,) = cq.wait(timeout=30)
        assert c.tag == 7 and c.status == n.STATUS_NOT_FOUND and "missing" in c.message
        with pytest.raises(n.NotFound):
            ev.synchronize()
        assert ev.status == n.STATUS_NOT_FOUND
        assert isinstance(n.status_error(c.status, c.message), n.NotFound)
    finally:
        s.close()
        store.close()


def test_completion_queue_notify_wakes_without_busy_wait():
    cq = n.CompletionQueue()
    out = {}
    started = threading.Event()

    def waiter():
        started.set()
        t0 = time.thread_time()
        out["items"] = cq.wait(timeout=60)
        out["cpu"] = time.thread_time() - t0

    t = threading.Thread(target=waiter)
    t.start()
    started.wait()
    # Whether notify lands before or during the wait, the waiter returns.
    cq.notify()
    t.join(timeout=30)
    assert not t.is_alive()
    assert out["items"] == []
    # A timed wait blocks on a condition variable: almost no CPU burnt.
    t0, c0 = time.monotonic(), time.thread_time()
    assert cq.wait(timeout=0.3) == []
    assert time.monotonic() - t0 >= 0.29
    assert time.thread_time() - c0 < 0.05


def test_elapsed_time_and_duration():
    s = n.Stream()
    try:
        src = n.aligned_buffer(64 << 20)
        dst = n.aligned_buffer(64 << 20)
        e1 = s.record()
        cp = s.copy(dst, src)
        e2 = s.record()
        e2.synchronize()
        assert e1.duration == 0.0 and e2.duration == 0.0
        assert cp.duration > 0 and cp.nbytes == 64 << 20
        ms = e1.elapsed_time(e2)
        assert ms >= cp.duration * 1000 * 0.99
        assert ms < 60_000
        assert e2.elapsed_time(e1) <= 0
        pending = s.copy(dst, src)
        s.synchronize()
        assert pending.query()
    finally:
        s.close()


def test_synchronize_timeout_returns_false(tmp_path):
    store = n.FileStore(str(tmp_path), engine="threads")
    s = n.Stream()
    try:
        store.write_sync("k", b"abc")
        n.inject_fault("read", "delay", delay_ms=500)
        ev = s.read(store, "k", bytearray(3))
        assert ev.synchronize(timeout=0.01) is False
        assert not ev.query()
        assert ev.synchronize(timeout=30) is True
    finally:
        n.clear_faults()
        s.close()
        store.close()


def test_buffers_kept_alive_until_completion():
    s = n.Stream()
    try:
        src = np.ones(1 << 20, dtype=np.uint8)
        dst = np.zeros(1 << 20, dtype=np.uint8)
        before = sys.getrefcount(src)
        ev = s.copy(dst, src)
        del src  # the op still holds the buffer
        ev.synchronize()
        assert dst.sum() == 1 << 20
        data = bytearray(4096)
        ev = s.checksum(data)
        ev.synchronize()
        data.extend(b"x")  # export released once the op completed and we synchronized
        assert before >= 2
    finally:
        s.close()


def test_stream_close_drains_and_rejects():
    s = n.Stream("c")
    src = n.aligned_buffer(8 << 20)
    dst = n.aligned_buffer(8 << 20)
    evs = [s.copy(dst, src) for _ in range(10)]
    s.close()
    assert all(e.query() for e in evs)
    with pytest.raises(n.Closed):
        s.record()
    s.close()  # idempotent


def test_copy_argument_checks():
    s = n.Stream()
    try:
        with pytest.raises(ValueError):
            s.copy(bytearray(10), b"x" * 11)
        with pytest.raises(ValueError):
            s.copy(bytearray(10), b"x" * 5, 6)
        with pytest.raises(BufferError):
            s.copy(b"readonly", b"x")
        ev = s.copy(bytearray(10), b"x" * 5, 3)
        ev.synchronize()
        assert ev.nbytes == 3
    finally:
        s.close()


def _pattern(nbytes, seed):
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


@pytest.mark.parametrize("nbytes", [0, 1, 63, 4096, n.BULK_COPY_MIN - 1, n.BULK_COPY_MIN,
                                    n.BULK_COPY_MIN + 1, (3 << 20) + 17])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 7), (13, 61), (64, 32)])
def test_bulk_copy_equals_memmove_at_any_alignment(nbytes, dst_off, src_off):
    # Streaming stores move 64 bytes at a time from a cache-line-aligned destination;
    # the head and tail around them are the cases that can go wrong.
    src = _pattern(nbytes + src_off + 64, nbytes)
    dst = np.full(nbytes + dst_off + 64, 0xA5, dtype=np.uint8)
    n.bulk_copy(dst[dst_off:dst_off + nbytes], src[src_off:src_off + nbytes])
    assert np.array_equal(dst[dst_off:dst_off + nbytes], src[src_off:src_off + nbytes])
    assert (dst[:dst_off] == 0xA5).all() and (dst[dst_off + nbytes:] == 0xA5).all()  # nothing outside


@pytest.mark.parametrize("shift", [-4097, -64, -1, 1, 64, 4097])
def test_bulk_copy_overlapping_ranges_are_a_memmove(shift):
    nbytes = 2 * n.BULK_COPY_MIN
    buf = _pattern(nbytes + 16384, 5)
    want = buf.copy()
    src_at, dst_at = 8192, 8192 + shift
    want[dst_at:dst_at + nbytes] = buf[src_at:src_at + nbytes].copy()
    n.bulk_copy(buf[dst_at:dst_at + nbytes], buf[src_at:src_at + nbytes])
    assert np.array_equal(buf, want)


def test_stream_copy_of_a_large_tensor_between_arena_and_host_pool():
    arena, pool, s = n.Arena(64 << 20, 2 << 20), n.HostPool(64 << 20, 2 << 20), n.Stream("bulk")
    try:
        nbytes = (24 << 20) + 12
        host, dev = pool.alloc(nbytes), arena.alloc(nbytes)
        want = _pattern(nbytes, 9)
        np.frombuffer(host, dtype=np.uint8)[:nbytes] = want
        assert s.copy(dev, host, nbytes).synchronize() is not False
        assert np.array_equal(np.frombuffer(dev, dtype=np.uint8)[:nbytes], want)
        np.frombuffer(host, dtype=np.uint8)[:] = 0
        s.copy(host, dev, nbytes).synchronize()
        assert np.array_equal(np.frombuffer(host, dtype=np.uint8)[:nbytes], want)
        host.release()
        dev.release()
    finally:
        s.close()


def test_bulk_copy_argument_checks():
    with pytest.raises(ValueError):
        n.bulk_copy(bytearray(10), b"x" * 11)
    with pytest.raises(BufferError):
        n.bulk_copy(b"readonly", b"x")


def test_no_leaked_threads_or_fds(tmp_path):
    t0, f0 = n_threads(), n_fds()
    for engine in ("threads", "aio", "buffered"):
        store = n.FileStore(str(tmp_path / engine), engine=engine, io_threads=3)
        streams = [n.Stream(str(i)) for i in range(3)]
        cq = n.CompletionQueue()
        data = np.arange(3 << 20, dtype=np.uint8)
        for i, s in enumerate(streams):
            s.write(store, f"k{i}", data, cq=cq)
        for s in streams:
            s.synchronize()
        for i, s in enumerate(streams):
            s.read(store, f"k{i}", np.empty_like(data), cq=cq)
        got = []
        while len(got) < 6:
            got += cq.wait(timeout=30)
        assert all(c.status == 0 for c in got)
        assert n_threads() > t0
        for s in streams:
            s.close()
        store.close()
        store.close()
    assert n_threads() == t0
    assert n_fds() == f0


def test_build_info():
    info = n.build_info()
    assert info["crc32c"] == n.crc32c_impl()
    assert info["page_size"] == os.sysconf("SC_PAGE_SIZE")
    assert info["o_direct_alignment"] == 4096
    assert info["bulk_copy"] in ("avx2-stream", "sse2-stream", "memmove")
    for k in ("version", "compiler", "cxx_std", "aio", "io_uring"):
        assert k in info


# ---------------------------------------------------------------- compute-fence word

def test_wait_word_wakes_on_a_store_and_times_out():
    buf = n.aligned_buffer(64)
    word = np.frombuffer(buf, np.int64, 1)
    word[0] = 3
    assert n.wait_word(buf, 2, 1.0) == 3                 # already there
    t = time.monotonic()
    assert n.wait_word(buf, 5, 0.2) == 3                 # not reached: returns at the timeout
    assert 0.15 < time.monotonic() - t < 2.0

    def later():
        time.sleep(0.1)
        word[0] = 7
    threading.Thread(target=later).start()
    assert n.wait_word(buf, 7, 5.0) == 7
    with pytest.raises(ValueError):
        n.wait_word(bytearray(4), 1, 0.1)


def test_arena_alloc_prefers_the_requested_offset_when_free():
    a = n.Arena(1 << 20)
    x, y, z = a.alloc(8192), a.alloc(8192), a.alloc(8192)
    off = y.offset
    y.release()
    w = a.alloc(4096, off + 4096)               # inside the hole, at its right half
    assert w.offset == off + 4096
    u = a.alloc(4096, off)                      # the left half is still free
    assert u.offset == off
    busy = a.alloc(4096, x.offset)              # taken: falls back to first fit
    assert busy.offset not in (x.offset, off, off + 4096)
    assert a.alloc(4096, 12345).offset >= 0     # unaligned preference: ignored


def test_a_source_tree_without_the_native_engine_says_so_instead_of_a_bare_import_error(tmp_path):
    """`pip install .` then python in the checkout: the checkout's prefetchd/ (no _native*.so)
    shadows the installed one. `-S` keeps the editable install's import hook out."""
    import shutil
    import site
    import subprocess
    import prefetchd
    tree = tmp_path / "checkout"
    shutil.copytree(os.path.dirname(prefetchd.__file__), tree / "prefetchd",
                    ignore=shutil.ignore_patterns("_native*.so", "__pycache__"))
    script = (f"import sys; sys.path[:0] = [{str(tree)!r}, *{site.getsitepackages()!r}]\n"
              "import prefetchd\n"
              "try:\n    prefetchd.Daemon(device_budget='1MiB').start()\n"
              "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-S", "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(f"prefetchd's native engine (_native*.so) is not built in {tree / 'prefetchd'}"), \
        out.stdout + out.stderr[-2000:]
    assert "pip install -e ." in out.stdout
