"""prefetchd._native.FileStore at its boundaries: permissions, unwritable directories, failed
opens that leave nothing, key validation (MAX_KEY_BYTES), the missing-key error, and
prefetchd.backend.base.open_store's errors and logging."""
import os

import pytest

n = pytest.importorskip("prefetchd._native")
from _store_helpers import flip_byte, mode, read_only_dir, tiny_fs, write_and_close  # noqa: F401 (fixtures)

pytestmark = pytest.mark.usefixtures("native_faults")     # no injected fault outlives a test


# ---------------------------------------------------------------- permissions, unwritable directories

def test_store_files_0600_and_directories_0700(tmp_path):
    d = str(tmp_path / "new")
    s = n.FileStore(d)
    try:
        s.write_sync("k", b"secret weights")
        assert mode(d) == 0o700
        assert mode(s.info("k")["path"]) == 0o600
        assert mode(os.path.join(d, ".pfd-lock")) == 0o600
    finally:
        s.close()
    path = write_and_close(d, "q", b"q")
    flip_byte(path, 60)
    s = n.FileStore(d)
    try:
        assert mode(os.path.join(d, "quarantine")) == 0o700
    finally:
        s.close()


def test_world_readable_files_of_older_builds_are_tightened_at_open(tmp_path):
    d = str(tmp_path)
    path = write_and_close(d, "k", b"x")
    os.chmod(path, 0o644)
    n.FileStore(d).close()
    assert mode(path) == 0o600


@pytest.mark.parametrize("direct", [True, False])
def test_unwritable_store_directory_is_an_error_at_open(read_only_dir, direct):
    with pytest.raises(n.IOFailure, match=rf"store directory {read_only_dir} is not writable.*EROFS"):
        n.FileStore(read_only_dir, direct=direct)


def test_failed_open_leaves_nothing_behind(tiny_fs):
    target = os.path.join(tiny_fs, "store")
    with pytest.raises(n.IOFailure, match=rf"store directory {target} is not writable.*ENOSPC"):
        n.FileStore(target)     # directory and lock file fit, the probe file does not
    assert os.listdir(tiny_fs) == []


# ---------------------------------------------------------------- keys

def test_key_limit_is_a_module_constant_and_checked_everywhere(tmp_path):
    assert n.MAX_KEY_BYTES == 1024
    s = n.FileStore(str(tmp_path))
    st = n.Stream()
    try:
        fits = "ü" * 512                        # 512 characters, 1024 bytes
        s.write_sync(fits, b"ok")
        assert s.contains(fits)
        too_long = "ü" * 513                    # fewer than 1024 characters, 1026 bytes
        msg = r"key is 1026 bytes; a store key must be 1\.\.1024 bytes of UTF-8 \(MAX_KEY_BYTES\)"
        for call in (lambda: s.write_sync(too_long, b"x"), lambda: s.read_sync(too_long, bytearray(1)),
                     lambda: s.info(too_long), lambda: s.contains(too_long), lambda: too_long in s,
                     lambda: s.remove(too_long), lambda: s.commit(too_long, 1),
                     lambda: st.read(s, too_long, bytearray(1)), lambda: st.write(s, too_long, b"x")):
            with pytest.raises(ValueError, match=msg):
                call()
        with pytest.raises(ValueError, match="key is 0 bytes"):
            s.write_sync("", b"x")
        with pytest.raises(ValueError, match=r"cannot be encoded as UTF-8"):
            s.write_sync("bad\udcff", b"x")
        with pytest.raises(TypeError, match="store key must be str, got bytes"):
            s.info(b"k")
        assert s.keys() == [fits] and st.pending == 0
    finally:
        st.close()
        s.close()


# ---------------------------------------------------------------- missing keys

def test_missing_key_raises_not_found_which_is_a_key_error(tmp_path):
    s = n.FileStore(str(tmp_path))
    st = n.Stream()
    try:
        for call in (lambda: s.info("ghost"), lambda: s.read_sync("ghost", bytearray(1)),
                     lambda: s.remove("ghost")):
            with pytest.raises(KeyError) as ei:
                call()
            assert isinstance(ei.value, n.NotFound) and isinstance(ei.value, n.NativeError)
            assert str(ei.value) == "key not found: 'ghost'"        # not KeyError's quoted repr
            assert ei.value.status == n.STATUS_NOT_FOUND
        ev = st.read(s, "ghost", bytearray(1))
        with pytest.raises(KeyError, match="key not found: 'ghost'"):
            ev.synchronize(timeout=30)
        assert ev.status == n.STATUS_NOT_FOUND
    finally:
        st.close()
        s.close()


# ---------------------------------------------------------------- open_store (prefetchd.backend.base)

def test_open_store_creates_a_private_directory(tmp_path):
    from prefetchd.backend.base import open_store
    from prefetchd.config import Config
    d = str(tmp_path / "a" / "store")
    s = open_store(Config.load(store_dir=d))
    try:
        assert mode(d) == 0o700 and s.directory == d
    finally:
        s.close()


def test_open_store_errors_name_store_dir(tmp_path, read_only_dir):
    from prefetchd.backend.base import open_store
    from prefetchd.config import Config
    from prefetchd.errors import StorageError
    d = str(tmp_path / "store")
    first = open_store(Config.load(store_dir=d))
    try:
        with pytest.raises(StorageError, match=rf"^store_dir {d}: store {d} is in use by pid {os.getpid()}"):
            open_store(Config.load(store_dir=d))
    finally:
        first.close()
    with pytest.raises(StorageError, match=rf"^store_dir {read_only_dir}: store directory .* is not writable"):
        open_store(Config.load(store_dir=read_only_dir))


def test_open_store_removes_its_temp_dir_when_the_open_fails(tiny_fs, monkeypatch):
    import tempfile
    from prefetchd.backend.base import open_store
    from prefetchd.config import Config
    from prefetchd.errors import StorageError
    monkeypatch.setattr(tempfile, "tempdir", tiny_fs)
    with pytest.raises(StorageError, match=r"^store_dir .*prefetchd-store-.* is not writable"):
        open_store(Config.load(store_dir=None))
    assert os.listdir(tiny_fs) == []


def test_open_store_logs_each_quarantined_file(tmp_path, caplog):
    from prefetchd.backend.base import open_store
    from prefetchd.config import Config
    d = str(tmp_path / "store")
    path = write_and_close(d, "k", b"x")
    flip_byte(path, 60)
    with caplog.at_level("WARNING", logger="prefetchd.store"):
        open_store(Config.load(store_dir=d)).close()
    [record] = [r for r in caplog.records if r.name == "prefetchd.store"]
    assert record.levelname == "WARNING"
    assert record.getMessage() == (f"store_dir {d}: recovery quarantined {path} (header checksum mismatch); "
                                   f"moved to {os.path.join(d, 'quarantine', os.path.basename(path))}")
