"""prefetchd._native.FileStore engine probe: O_DIRECT and kernel AIO where the filesystem has
them, buffered I/O where it does not (ramfs, older tmpfs), bad options refused."""
import os

import numpy as np
import pytest

n = pytest.importorskip("prefetchd._native")
from _store_helpers import ramfs  # noqa: E402,F401 (a fixture)


def payload(size, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)


# ---------------------------------------------------------------- engine probe

def test_auto_engine_on_ext4_uses_direct_io(tmp_path):
    s = n.FileStore(str(tmp_path))
    try:
        assert s.direct and s.engine in ("aio", "threads")
        assert "O_DIRECT ok" in s.probe_report and s.engine in s.probe_report
        assert not [f for f in os.listdir(str(tmp_path)) if "probe" in f]  # scratch file removed
        assert (s.block_size, s.queue_depth, s.io_threads, s.extent_size) == (8 << 20, 8, 4, 1 << 20)
    finally:
        s.close()


def odirect_works(d):
    path = os.path.join(d, ".odirect-check")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_DIRECT)
    except OSError:
        if os.path.exists(path):  # open(O_CREAT) creates the file before rejecting O_DIRECT
            os.unlink(path)
        return False
    os.close(fd)
    os.unlink(path)
    return True


def roundtrip(s):
    src = payload(5_000_000, 8)
    s.write_sync("k", src)
    out = np.zeros_like(src)
    s.read_sync("k", out)
    assert np.array_equal(out, src)


def test_filesystem_without_o_direct_falls_back_to_buffered(ramfs):
    assert not odirect_works(ramfs)
    s = n.FileStore(ramfs)
    try:
        assert s.engine == "buffered" and not s.direct
        assert "O_DIRECT open failed (EINVAL)" in s.probe_report and "-> buffered" in s.probe_report
        assert os.listdir(ramfs) == [".pfd-lock"]  # probe scratch file removed
        roundtrip(s)
    finally:
        s.close()
    s = n.FileStore(ramfs, engine="aio")  # an explicit engine cannot force O_DIRECT either
    try:
        assert s.engine == "buffered" and not s.direct
        roundtrip(s)
    finally:
        s.close()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")
def test_store_on_dev_shm():
    import shutil
    import tempfile
    d = tempfile.mkdtemp(dir="/dev/shm", prefix="pfd-test-")
    try:
        s = n.FileStore(d)
        try:
            if odirect_works(d):  # tmpfs on Linux >= 6.6
                assert s.direct and "O_DIRECT ok" in s.probe_report
            else:
                assert s.engine == "buffered" and not s.direct
                assert "O_DIRECT open failed" in s.probe_report
            roundtrip(s)
        finally:
            s.close()
        s = n.FileStore(d, direct=False)
        try:
            assert s.engine == "buffered" and not s.direct
            roundtrip(s)
        finally:
            s.close()
    finally:
        shutil.rmtree(d)


def test_bad_options_rejected(tmp_path):
    with pytest.raises(ValueError):
        n.FileStore(str(tmp_path), engine="io_uring_please")
    with pytest.raises(ValueError):
        n.FileStore(str(tmp_path), block_size=1000)
    with pytest.raises(ValueError):
        n.FileStore(str(tmp_path), queue_depth=0)
