"""Helpers shared by the FileStore safety tests: damage files, read file modes, mount small filesystems."""
import os
import stat
import subprocess

import pytest

from prefetchd import _native as n

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))


def data_offset(path, nbytes):
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


@pytest.fixture
def read_only_dir(tmp_path):
    d = str(tmp_path / "ro")
    os.mkdir(d)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", d], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here: " + r.stderr.decode(errors="replace").strip())
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=True)


@pytest.fixture
def tiny_fs(tmp_path):
    """A tmpfs with room for 3 inodes: its root, one directory and one file."""
    d = str(tmp_path / "tiny")
    os.mkdir(d)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "nr_inodes=3,size=1m", "tmpfs", d], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount tmpfs here: " + r.stderr.decode(errors="replace").strip())
    try:
        yield d
    finally:
        subprocess.run(["umount", d], check=True)


