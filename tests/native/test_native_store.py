"""prefetchd._native.FileStore: round trips on every engine, integrity, crash safety, recovery, faults."""
import errno
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

n = pytest.importorskip("prefetchd._native")
from _store_helpers import REPO, data_offset, read_key  # noqa: E402

ENGINES = ("aio", "threads", "buffered")

pytestmark = pytest.mark.usefixtures("native_faults")     # no injected fault outlives a test


@pytest.fixture
def store(tmp_path):
    s = n.FileStore(str(tmp_path / "store"), engine="threads", block_size=1 << 20, extent_size=1 << 20)
    yield s
    s.close()


def payload(size, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


def files(d, suffix=""):
    return sorted(f for f in os.listdir(d) if f.endswith(suffix))


# ---------------------------------------------------------------- round trips

@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 1 << 20, 3_000_001, (17 << 20) + 5])
def test_round_trip_bit_exact(tmp_path, engine, size):
    s = n.FileStore(str(tmp_path), engine=engine, block_size=4 << 20, queue_depth=4)
    try:
        assert s.engine == engine
        assert s.direct == (engine != "buffered")
        src = payload(size, seed=size)
        v = s.write_sync("t", src, meta=b"shape=(%d,)" % size)
        info = s.info("t")
        assert info["version"] == v and info["nbytes"] == size and info["meta"] == b"shape=(%d,)" % size
        assert info["crc"] == n.crc32c(src)
        # plain numpy destination (generally not page-aligned: bounce path)
        out = np.zeros(size, dtype=np.uint8)
        assert s.read_sync("t", out) == size
        assert np.array_equal(out, src)
        # aligned destination with capacity >= padded size: read in place
        blk = n.aligned_buffer(size)
        assert s.read_sync("t", blk) == size
        assert np.array_equal(np.frombuffer(blk, dtype=np.uint8), src)
        # the file is header + data padded to 4096
        assert data_offset(info["path"], size) % 4096 == 0
    finally:
        s.close()


def test_round_trip_256mib_into_arena(tmp_path):
    size = 256 << 20
    s = n.FileStore(str(tmp_path))  # auto engine, default tuning
    arena = n.Arena(size + (1 << 20))
    try:
        src = n.aligned_buffer(size)
        view = np.frombuffer(src, dtype=np.uint64)
        view[:] = np.arange(view.size, dtype=np.uint64) * 0x9E3779B97F4A7C15
        s.write_sync("big", src)
        dst = arena.alloc(size)
        assert s.read_sync("big", dst) == size
        assert np.array_equal(np.frombuffer(dst, dtype=np.uint64), view)
        assert s.info("big")["crc"] == n.crc32c(dst)
    finally:
        s.close()
        arena.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_unaligned_destination_and_source(tmp_path, engine):
    s = n.FileStore(str(tmp_path), engine=engine, block_size=1 << 20)
    try:
        size = (2 << 20) + 123
        raw = bytearray(size + 1)
        src = memoryview(raw)[1:]  # odd address
        src[:] = payload(size, 3).tobytes()
        s.write_sync("u", src)
        back = bytearray(size + 7)
        dst = memoryview(back)[3:3 + size]
        assert s.read_sync("u", dst) == size
        assert bytes(dst) == bytes(src)
        # destination larger than the data: only nbytes are written
        big = bytearray(b"\xee" * (size + 10))
        s.read_sync("u", big)
        assert big[size:] == b"\xee" * 10
        with pytest.raises(ValueError):
            s.read_sync("u", bytearray(size - 1))
    finally:
        s.close()


def test_empty_tensor_and_key_encoding(store):
    store.write_sync("empty", b"")
    assert store.read_sync("empty", bytearray(0)) == 0
    weird = "layer.0/weight ü 💥 " + "x" * 900
    store.write_sync(weird, b"abc")
    out = bytearray(3)
    store.read_sync(weird, out)
    assert out == b"abc"
    assert set(store.keys()) == {"empty", weird}
    for f in os.listdir(store.directory):
        assert "/" not in f and f.isascii()
    with pytest.raises(ValueError):
        store.write_sync("k" * 1025, b"x")
    with pytest.raises(ValueError):
        store.write_sync("m", b"x", meta=b"0" * (64 * 1024 + 1))


def test_queries_remove_and_versions(store):
    assert store.keys() == [] and store.bytes_stored() == 0
    v1 = store.write_sync("a", b"1" * 5000)
    v2 = store.write_sync("a", b"2" * 6000)
    assert v2 > v1
    store.write_sync("b", b"3" * 10, nbytes=7)
    assert store.contains("a") and "b" in store and not store.contains("c")
    assert store.bytes_stored() == 6007
    assert len(files(store.directory, ".pfd")) == 2  # the old version of "a" is gone
    out = bytearray(6000)
    store.read_sync("a", out)
    assert out == b"2" * 6000
    store.remove("b")
    assert not store.contains("b")
    with pytest.raises(n.NotFound):
        store.remove("b")
    with pytest.raises(n.NotFound):
        store.info("b")
    with pytest.raises(n.NotFound, match="'b'"):
        store.read_sync("b", bytearray(10))
    assert len(files(store.directory, ".pfd")) == 1


def test_closed_store_raises(tmp_path):
    s = n.FileStore(str(tmp_path))
    s.write_sync("k", b"x")
    s.close()
    s.close()
    with pytest.raises(n.Closed):
        s.read_sync("k", bytearray(1))
    with pytest.raises(n.Closed):
        s.write_sync("k", b"y")
    # Queries too: they answered from the closed store's stale index (an outside probe).
    for query in (s.keys, lambda: s.contains("k"), lambda: "k" in s, lambda: s.info("k"),
                  s.bytes_stored, lambda: s.remove("k"), lambda: s.commit("k", 1)):
        with pytest.raises(n.Closed):
            query()
    assert s.engine in ("aio", "threads", "buffered")      # what it was opened with stays readable
    st = n.Stream()
    try:
        with pytest.raises(n.Closed):
            st.read(s, "k", bytearray(1))
    finally:
        st.close()


def test_stream_read_write_with_completion_queue(store):
    s = n.Stream("io")
    cq = n.CompletionQueue()
    try:
        src = payload(3 << 20, 9)
        w = s.write(store, "k", src, meta=b"m", tag=1, cq=cq)
        dst = np.zeros_like(src)
        r = s.read(store, "k", dst, tag=2, cq=cq)
        got = []
        while len(got) < 2:
            got += cq.wait(timeout=30)
        assert [c.tag for c in got] == [1, 2]
        assert w.synchronize() and r.synchronize()
        assert w.result == store.info("k")["version"] and w.nbytes == src.nbytes
        assert r.nbytes == src.nbytes and np.array_equal(dst, src)
    finally:
        s.close()


# ---------------------------------------------------------------- integrity

@pytest.mark.parametrize("engine", ENGINES)
def test_corruption_detected_on_read(tmp_path, engine):
    s = n.FileStore(str(tmp_path), engine=engine, block_size=1 << 20, extent_size=1 << 20)
    try:
        size = (3 << 20) + 5
        src = payload(size, 4)
        s.write_sync("c", src)
        path = s.info("c")["path"]
        with open(path, "r+b") as f:  # flip one byte in extent 2
            at = data_offset(path, size) + (2 << 20) + 1234
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))
        if engine != "buffered":
            pass  # O_DIRECT reads bypass the page cache anyway
        with pytest.raises(n.ChecksumMismatch, match=r"key 'c'.*extent 2 of 4"):
            s.read_sync("c", np.zeros(size, dtype=np.uint8))
        out = np.zeros(size, dtype=np.uint8)
        s.read_sync("c", out, verify=False)  # opting out returns the bytes as stored
        assert (out != src).sum() == 1
    finally:
        s.close()


def quarantined_paths(s):
    return [q["path"] for q in s.recovery_report["quarantined"]]


def test_corrupted_header_is_quarantined_on_open(tmp_path):
    d = str(tmp_path)
    s = n.FileStore(d)
    s.write_sync("h", b"data" * 100)
    path = s.info("h")["path"]
    s.close()
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\x00\x01")
    with open(path, "rb") as f:
        damaged = f.read()
    s = n.FileStore(d)
    try:
        assert not s.contains("h")
        [q] = s.quarantined
        assert q == {"path": path, "moved_to": os.path.join(d, "quarantine", os.path.basename(path)),
                     "reason": "header checksum mismatch"}
        assert s.recovery_report["quarantined"] == [q]
        assert not os.path.exists(path)
        with open(q["moved_to"], "rb") as f:  # set aside byte for byte, not deleted
            assert f.read() == damaged
    finally:
        s.close()


# ---------------------------------------------------------------- crash safety and recovery

def test_recovery_removes_tmp_and_keeps_newest_valid(tmp_path):
    d = str(tmp_path)
    s = n.FileStore(d)
    s.write_sync("k", b"old" * 1000)
    old_path = s.info("k")["path"]
    with open(old_path, "rb") as f:
        old_bytes = f.read()
    s.write_sync("k", b"new" * 1000)
    new_path = s.info("k")["path"]
    s.close()
    assert not os.path.exists(old_path)
    # Simulate crashes: the old version was never unlinked, a write was torn,
    # and a garbage file claims an even newer version.
    with open(old_path, "wb") as f:
        f.write(old_bytes)
    stem = os.path.basename(new_path).split(".")[0]
    tmp = os.path.join(d, stem + ".00000000000000ff.tmp")
    with open(tmp, "wb") as f:
        f.write(b"torn")
    bad = os.path.join(d, stem + ".00000000000000fe.pfd")
    with open(bad, "wb") as f:
        f.write(os.urandom(8192))
    s = n.FileStore(d)
    try:
        rep = s.recovery_report
        assert rep == {"kept": 1, "removed_tmp": [tmp], "removed_old": 1,
                       "quarantined": [{"path": bad, "moved_to": os.path.join(d, "quarantine", os.path.basename(bad)),
                                        "reason": "bad magic"}]}
        assert files(d) == [".pfd-lock", os.path.basename(new_path), "quarantine"]
        out = bytearray(3000)
        s.read_sync("k", out)
        assert out == b"new" * 1000
        assert s.write_sync("k", b"x") > 0xFE  # versions keep increasing past what was seen
    finally:
        s.close()


def _two_versions_on_disk(d):
    """Write version A then B of key "k", and put A's file back (as if B's unlink of
    older versions had not happened): (version of A, path of A, path of B)."""
    s = n.FileStore(d)
    v1 = s.write_sync("k", b"A" * 10000)
    p1 = s.info("k")["path"]
    with open(p1, "rb") as f:
        keep = f.read()
    s.write_sync("k", b"B" * 10000)
    p2 = s.info("k")["path"]
    s.close()
    with open(p1, "wb") as f:
        f.write(keep)
    return v1, p1, p2


def test_recovery_falls_back_to_older_version_when_newest_is_torn(tmp_path):
    d = str(tmp_path)
    v1, p1, p2 = _two_versions_on_disk(d)
    with open(p2, "r+b") as f:  # truncated: size no longer matches its header
        f.truncate(os.path.getsize(p2) - 4096)
    s = n.FileStore(d)
    try:
        assert s.info("k")["version"] == v1
        assert quarantined_paths(s) == [p2]
        assert "does not match its header" in s.quarantined[0]["reason"]
        assert read_key(s, "k") == b"A" * 10000
    finally:
        s.close()


def test_verify_data_on_open_drops_corrupt_data(tmp_path):
    d = str(tmp_path)
    v1, p1, p2 = _two_versions_on_disk(d)
    with open(p2, "r+b") as f:
        f.seek(data_offset(p2, 10000) + 5)
        f.write(b"Z")
    s = n.FileStore(d, verify_data_on_open=True)
    try:
        assert s.info("k")["version"] == v1
        assert quarantined_paths(s) == [p2]
        assert s.quarantined[0]["reason"] == "checksum mismatch in extent 0"
        assert s.recover(verify_data=True)["kept"] == 1
    finally:
        s.close()


FSIZE_SCRIPT = textwrap.dedent("""
    import resource, sys, os
    import numpy as np
    from prefetchd import _native as n
    d, engine = sys.argv[1], sys.argv[2]
    s = n.FileStore(d, engine=engine, block_size=1 << 20)
    old = np.full(1 << 20, 7, dtype=np.uint8)
    s.write_sync("k", old)
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 20, resource.RLIM_INFINITY))
    try:
        s.write_sync("k", np.full(8 << 20, 9, dtype=np.uint8))
    except n.IOFailure as e:
        print("IOFailure:", e)
    else:
        print("no error")
    out = np.zeros(1 << 20, dtype=np.uint8)
    s.read_sync("k", out)
    print("old intact:", bool((out == 7).all()), "version", s.info("k")["version"])
    print("files:", sorted(os.listdir(d)))
    s.close()
""")


@pytest.mark.parametrize("engine", ENGINES)
def test_failed_write_rlimit_fsize_keeps_old_version(tmp_path, engine):
    d = str(tmp_path / "s")
    r = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, d, engine], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr  # SIGXFSZ would kill the process
    assert "IOFailure: write failed: key 'k': EFBIG" in r.stdout, r.stdout
    assert "old intact: True version 1" in r.stdout
    assert ".tmp" not in r.stdout.split("files:")[1]


@pytest.mark.parametrize("engine", ENGINES)
def test_injected_enospc_keeps_old_version(tmp_path, engine):
    s = n.FileStore(str(tmp_path), engine=engine)
    try:
        s.write_sync("k", b"old!" * 4096)
        n.inject_fault("write", "error", err=errno.ENOSPC)
        with pytest.raises(n.IOFailure, match=r"write failed: key 'k': ENOSPC") as ei:
            s.write_sync("k", b"new!" * 8192)
        assert ei.value.status == errno.ENOSPC
        assert n.faults_fired() == 1
        assert files(str(tmp_path), ".tmp") == []
        out = bytearray(4 * 4096)
        s.read_sync("k", out)
        assert out == b"old!" * 4096 and s.info("k")["version"] == 1
    finally:
        s.close()


# ---------------------------------------------------------------- fault injection

@pytest.mark.parametrize("engine", ENGINES)
def test_each_fault_kind_surfaces_precisely(tmp_path, engine):
    s = n.FileStore(str(tmp_path), engine=engine, block_size=1 << 20)
    try:
        src = payload(3 << 20, 5)
        s.write_sync("k", src)
        out = np.zeros_like(src)

        n.inject_fault("read", "error", err=errno.EIO)
        with pytest.raises(n.IOFailure, match=r"read failed: key 'k': EIO") as ei:
            s.read_sync("k", out)
        assert ei.value.status == errno.EIO

        n.inject_fault("read", "short")
        with pytest.raises(n.IOFailure, match=r"short read") as ei:
            s.read_sync("k", out)
        assert ei.value.status == n.STATUS_SHORT_READ

        n.inject_fault("read", "bitflip")
        with pytest.raises(n.ChecksumMismatch, match=r"key 'k'.*extent 0 ") as ei:
            s.read_sync("k", out)
        assert ei.value.status == n.STATUS_CHECKSUM

        n.inject_fault("write", "short")
        with pytest.raises(n.IOFailure, match=r"write failed: key 'k': short write"):
            s.write_sync("k", src[:100])
        n.inject_fault("write", "error", err=errno.EFBIG)
        with pytest.raises(n.IOFailure, match="EFBIG"):
            s.write_sync("k", src[:100])
        assert files(str(tmp_path), ".tmp") == []

        n.inject_fault("read", "delay", delay_ms=150)
        st = n.Stream()
        ev = st.read(s, "k", out)
        ev.synchronize()
        st.close()
        assert ev.duration >= 0.15
        assert np.array_equal(out, src)  # delay alone does not corrupt anything
        assert n.faults_fired() == 6
    finally:
        s.close()


def test_fault_nth_count_and_key_filter(store):
    store.write_sync("a/w", b"x" * 100)
    store.write_sync("b/w", b"y" * 100)
    out = bytearray(100)
    n.inject_fault("read", "error", nth=2, count=2, key_contains="a/")
    store.read_sync("b/w", out)  # does not match the filter
    store.read_sync("a/w", out)  # 1st match: passes
    for _ in range(2):
        with pytest.raises(n.IOFailure):
            store.read_sync("a/w", out)
    store.read_sync("a/w", out)  # count exhausted
    assert n.faults_fired() == 2
    n.clear_faults()
    assert n.faults_fired() == 0
    with pytest.raises(ValueError):
        n.inject_fault("read", "explode")
    with pytest.raises(ValueError):
        n.inject_fault("stat", "error")


def test_faults_from_environment(tmp_path):
    script = textwrap.dedent("""
        import sys
        from prefetchd import _native as n
        s = n.FileStore(sys.argv[1])
        s.write_sync("k", b"z" * 10)
        out = bytearray(10)
        for i in range(3):
            try:
                s.read_sync("k", out)
                print("ok")
            except n.IOFailure as e:
                print("fail", e.status)
        try:
            s.write_sync("k", b"q")
        except n.IOFailure as e:
            print("wfail short" if "short write" in str(e) else "wfail")
        print("fired", n.faults_fired())
    """)
    env = dict(os.environ, PREFETCHD_FAULTS="read:error:nth=2:err=5;write:short:nth=2")
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "fail", "5", "ok", "wfail", "short", "fired", "2"]
