"""Helpers shared by the FileStore safety tests: damage files, read file modes, mount small filesystems."""
import os
import stat
import subprocess

import pytest

from prefetchd import _native as n

from helpers import ENV, REPO  # noqa: F401 (re-exported for the store tests)


def data_offset(path, nbytes):
    """Where the data starts: the header is whatever precedes the padded data."""
    return os.path.getsize(path) - (-(-nbytes // 4096) * 4096)


def flip_byte(path, at):
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def mode(path):
    return stat.S_IMODE(os.lstat(path).st_mode)


def write_and_close(d, key, data):
    s = n.FileStore(d)
    s.write_sync(key, data)
    path = s.info(key)["path"]
    s.close()
    return path


def read_key(store, key):
    """The bytes `store` holds for `key` (read and checked, all of them)."""
    out = bytearray(store.info(key)["nbytes"])
    store.read_sync(key, out)
    return bytes(out)


def daemon_open_meets(store_dir):
    """What a daemon opening `store_dir` now meets: "opened" (it opened and closed it), or the
    StoreInUse refusal's message."""
    try:
        n.FileStore(str(store_dir)).close()
        return "opened"
    except n.StoreInUse as e:
        return str(e)


def _mounted(d, fstype, options=None):
    """Mount a fresh `fstype` at d for the test (skipped where mounting is not allowed)."""
    os.mkdir(d)
    args = ["mount", "-t", fstype] + (["-o", options] if options else []) + [fstype, d]
    r = subprocess.run(args, capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount {fstype} here: " + r.stderr.decode(errors="replace").strip())
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=True)


@pytest.fixture
def read_only_dir(tmp_path):
    yield from _mounted(str(tmp_path / "ro"), "tmpfs", "ro,size=1m")


@pytest.fixture
def tiny_fs(tmp_path):
    """A tmpfs with room for 3 inodes: its root, one directory and one file."""
    yield from _mounted(str(tmp_path / "tiny"), "tmpfs", "nr_inodes=3,size=1m")


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs: room for a few hundred KiB of tensors, not for a model of megabytes."""
    yield from _mounted(str(tmp_path / "small"), "tmpfs", "size=2m")


@pytest.fixture
def ramfs(tmp_path):
    """A filesystem without O_DIRECT. (tmpfs has O_DIRECT since Linux 6.6; ramfs never had it.)"""
    yield from _mounted(str(tmp_path / "ramfs"), "ramfs")
