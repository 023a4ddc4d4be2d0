"""Hostile checkpoints (issue #30): each is refused quickly with one line naming the file and the
tensor, before the store is touched; a FIFO never blocks `stage`; overlapping entries are refused;
a new generation that reads back wrong is never swapped in."""
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from prefetchd.staging import StagingError, iter_checkpoint, read_index, stage_checkpoint
from ckpt_files import ckpt_value, write_safetensors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F32 = np.arange(6, dtype=np.float32).tobytes()


def safetensors(path, header, data=b""):
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)
    return str(path)


def refused(path, store, pattern):
    with pytest.raises(StagingError) as info:
        stage_checkpoint(path, store)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert pattern in message, message
    assert len(message) < 400, f"{len(message)} characters: {message[:400]}"
    assert not os.path.exists(store), "a refused stage created the store"
    return message


def stage_cli(path, store, timeout=30):
    """`prefetchd stage` in a child, bounded: (exit code, stderr lines); a hang fails the test."""
    try:
        out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "stage", str(path), "--store", str(store),
                              "--quiet"], capture_output=True, text=True, cwd=REPO, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"prefetchd stage {path} still running after {timeout} s")
    return out.returncode, out.stderr.strip().splitlines()


def entry(dtype="F32", shape=(1,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def test_a_hundred_thousand_dims_are_refused_in_linear_time(tmp_path):
    # 2 MB of header: the exact product of these dims took ~30 s (quadratic big-int products),
    # then str() of it raised a bare ValueError naming no file.
    path = safetensors(tmp_path / "dims.safetensors", {"w": entry(shape=[2 ** 62] * 100_000)}, bytes(4))
    started = time.monotonic()
    code, lines = stage_cli(path, tmp_path / "store", timeout=15)
    assert time.monotonic() - started < 15
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith(f"prefetchd: error: {path}: tensor 'w': shape has 100000 dimensions"), lines[0]
    assert not os.path.exists(tmp_path / "store")


def test_a_ckpt_with_a_hundred_thousand_dims_is_refused_in_linear_time(tmp_path, ms):
    path = str(tmp_path / "dims.ckpt")
    with open(path, "wb") as f:
        f.write(ckpt_value("w", [2 ** 62] * 100_000, "Float32", F32))
    started = time.monotonic()
    refused(path, str(tmp_path / "store"), "tensor 'w': shape has 100000 dimensions")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("header, field", [
    (b"[" * 100_000 + b"]" * 100_000, "header nests too deeply"),
    (b'{"w": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "header nests too deeply"),
    (b'{"\xff\xfe": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "header is not UTF-8 (byte 10"),
    (b'{"\\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "name cannot be encoded as UTF-8"),
    ({"": entry()}, "tensor '': name is empty"),
    ({"k" * 2000: entry()}, "name is 2000 bytes of UTF-8; a store key holds at most 1024"),
    ({"a\0b": entry()}, "tensor 'a\\x00b': name contains a NUL character"),
    ({"w": entry(dtype=["F32"])}, "tensor 'w': dtype ['F32'] has no numpy equivalent"),
    ({"w": entry(dtype="F8_E5M2")}, "tensor 'w': dtype 'F8_E5M2' has no numpy equivalent"),
    ({"w": entry(shape=[2 ** 40, 2 ** 40])}, "tensor 'w': shape [1099511627776, 1099511627776] overflows"),
    ({"w": entry(shape=[2 ** 62, 2 ** 62, 0], offsets=(0, 0))}, "overflows: its elements times 4 bytes"),
    ({"w": entry(shape=[1] * 40)}, "tensor 'w': shape has 40 dimensions; at most 32"),
    ({"__metadata__": [1], "w": entry()}, "__metadata__ is a JSON list, not an object"),
    (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
     b'"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', "header names 'w' twice"),
    (b'{"__metadata__": {"crc_num": Infinity}, "w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}',
     "__metadata__.crc_num inf is not a CRC-32"),
    ({"__metadata__": {"crc_num": 1e400}, "w": entry()}, "__metadata__.crc_num inf is not a CRC-32"),
    ({"__metadata__": {"crc_num": True}, "w": entry()}, "__metadata__.crc_num True is not a CRC-32"),
    ({"__metadata__": {"crc_num": 1.5}, "w": entry()}, "__metadata__.crc_num 1.5 is not a CRC-32"),
    ({"__metadata__": {"crc_num": str(2 ** 32)}, "w": entry()}, "crc_num 4294967296 is not a CRC-32"),
], ids=["deep-list", "deep-entry", "non-utf8", "surrogate", "empty-name", "long-name", "nul-name", "dtype-list",
        "dtype-unknown", "product-overflow", "overflow-with-zero", "rank", "metadata-list", "duplicate",
        "crc-infinity", "crc-1e400", "crc-bool", "crc-float", "crc-out-of-range"])
def test_hostile_safetensors_headers_are_one_line_naming_the_file(tmp_path, header, field):
    path = safetensors(tmp_path / "bad.safetensors", header, bytes(4))
    refused(path, str(tmp_path / "store"), field)


@pytest.mark.parametrize("value, field", [
    (ckpt_value("", [6], "Float32", F32), "tensor '': name is empty"),
    (ckpt_value("n" * 1500, [6], "Float32", F32), "name is 1500 bytes of UTF-8"),
    (ckpt_value("a\0b", [6], "Float32", F32), "name contains a NUL character"),
    (ckpt_value("w", [2 ** 62, 2 ** 62, 0], "Float32", b""), "tensor 'w': shape [4611686018427387904, "
                                                           "4611686018427387904, 0] overflows"),
    (ckpt_value("w", [1] * 33, "Float32", F32[:4]), "tensor 'w': shape has 33 dimensions"),
], ids=["empty-name", "long-name", "nul-name", "overflow", "rank"])
def test_hostile_ckpt_values_are_one_line_naming_the_file(tmp_path, ms, value, field):
    path = str(tmp_path / "bad.ckpt")
    with open(path, "wb") as f:
        f.write(value)
    refused(path, str(tmp_path / "store"), field)


def test_overlapping_entries_are_refused_naming_both(tmp_path):
    # 64 names over the same 16 bytes would have become 1 KiB of store (x64)
    path = safetensors(tmp_path / "overlap.safetensors",
                       {f"w{i}": entry(shape=[4], offsets=(0, 16)) for i in range(64)}, bytes(16))
    refused(path, str(tmp_path / "store"), "tensor 'w1': data_offsets [0, 16] overlap those of tensor 'w0'")
    path = safetensors(tmp_path / "partial.safetensors",
                       {"a": entry(shape=[4], offsets=(0, 16)), "b": entry(shape=[2], offsets=(12, 20)),
                        "c": entry(shape=[1], offsets=(20, 24))}, bytes(24))
    refused(path, str(tmp_path / "store"), "tensor 'b': data_offsets [12, 20] overlap those of tensor 'a', [0, 16]")
    # adjacent ranges and empty tensors anywhere are fine
    path = safetensors(tmp_path / "fine.safetensors",
                       {"a": entry(shape=[4], offsets=(0, 16)), "e": entry(shape=[0], offsets=(8, 8)),
                        "b": entry(shape=[2], offsets=(16, 24))}, bytes(24))
    assert sorted(t[0] for t in iter_checkpoint(path)) == ["a", "b", "e"]


def test_a_fifo_or_device_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "model.safetensors"
    os.mkfifo(fifo)
    code, lines = stage_cli(fifo, tmp_path / "store", timeout=30)
    assert code == 1 and lines == [f"prefetchd: error: {fifo}: is a FIFO, not a checkpoint file"], lines
    os.mkfifo(tmp_path / "model.ckpt")
    refused(str(tmp_path / "model.ckpt"), str(tmp_path / "store"), "is a FIFO, not a checkpoint file")
    os.symlink("/dev/zero", tmp_path / "zero.ckpt")
    refused(str(tmp_path / "zero.ckpt"), str(tmp_path / "store"), "is a character device, not a checkpoint file")


@pytest.mark.parametrize("kind", ["bitflip", "error"])
def test_a_generation_that_reads_back_wrong_is_not_swapped_in(tmp_path, native_faults, kind):
    path, store = str(tmp_path / "m.safetensors"), str(tmp_path / "store")
    old = {"a": np.arange(300_000, dtype=np.float32), "b": np.arange(10, dtype=np.int8)}
    write_safetensors(path, old)
    assert stage_checkpoint(path, store)["generation"] == 1
    write_safetensors(path, {"a": -old["a"], "b": old["b"] + 1})
    # the read back of the new generation's first tensor returns a flipped bit / fails (the store's
    # own fault injection: this disk does not corrupt data on demand)
    native_faults.inject_fault("read", kind, nth=1)
    with pytest.raises(StagingError) as info:
        stage_checkpoint(path, store)
    message = str(info.value)
    assert native_faults.faults_fired() == 1
    assert message.startswith(f"{path}: tensor ") and "read back wrong from the new generation" in message
    assert message.endswith("nothing was swapped in, the store keeps generation 1") and "\n" not in message
    native_faults.clear_faults()
    assert read_index(store)["generation"] == 1
    assert [d for d in os.listdir(tmp_path) if ".staging-" in d] == []
    staged = {n: np.array(b) for n, _, _, b in _read_store(store)}
    assert {n: a.tobytes() for n, a in staged.items()} == {n: a.tobytes() for n, a in old.items()}
    # with a healthy disk the same stage goes through, every tensor read back first
    assert stage_checkpoint(path, store)["generation"] == 2


def _read_store(store_dir):
    from prefetchd import _native
    from prefetchd.staging import read_meta
    store = _native.FileStore(store_dir)
    try:
        for key in sorted(store.keys()):
            info = store.info(key)
            shape, dtype = read_meta(info)
            buf = bytearray(info["nbytes"])
            store.read_sync(key, buf)
            yield key, shape, dtype, buf
    finally:
        store.close()


def test_a_failed_write_is_one_line_naming_the_file_and_keeps_the_old_generation(tmp_path, native_faults):
    import errno
    path, store = str(tmp_path / "m.safetensors"), str(tmp_path / "store")
    write_safetensors(path, {"a": np.arange(1000, dtype=np.float32)})
    assert stage_checkpoint(path, store)["generation"] == 1
    write_safetensors(path, {"a": np.zeros(1000, dtype=np.float32), "b": np.ones(3, dtype=np.int8)})
    native_faults.inject_fault("write", "error", nth=2, err=errno.ENOSPC)
    with pytest.raises(StagingError) as info:
        stage_checkpoint(path, store)
    message = str(info.value)
    assert message.startswith(f"{path}: writing the new generation failed (") and "ENOSPC" in message, message
    assert message.endswith("the store keeps generation 1") and "\n" not in message
    native_faults.clear_faults()
    assert read_index(store)["generation"] == 1 and sorted(read_index(store)["tensors"]) == ["a"]


SHRINK = """
import os, sys
from prefetchd.staging import StagingError, iter_checkpoint
path = sys.argv[1]
reader = iter_checkpoint(path)                 # its structure read; then the file is overwritten
os.truncate(path, os.path.getsize(path) // 2)
try:
    for name, shape, dtype, data in reader:
        bytes(data[-1:])                       # as the stage's writer reads it
    print("no error")
except StagingError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("kind", ["ckpt", "safetensors"])
def test_a_checkpoint_that_shrinks_while_it_is_read_is_refused(tmp_path, ms, kind):
    """A file overwritten in place while it was staged (save_checkpoint to the same path): the
    reader mapped it, and the pages past its new end raised SIGBUS, the stage process killed
    without a word. It is read with pread now: a short read is an error naming the file."""
    path = str(tmp_path / f"w.{kind}")
    big = np.arange(1 << 18, dtype=np.float32)
    if kind == "ckpt":
        ms.save_checkpoint([{"name": "a", "data": ms.Tensor(big)}, {"name": "b", "data": ms.Tensor(big)}], path)
    else:
        write_safetensors(path, {"a": big, "b": big})
    size = os.path.getsize(path)
    out = subprocess.run([sys.executable, "-c", SHRINK, path], capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith(f"refused: {path}: the file ends at byte {size // 2} now, it had {size} "
                                 f"bytes when staging began"), out.stdout


def test_a_store_path_that_cannot_be_made_is_one_line(tmp_path):
    """Under a file, the stage said `[Errno 17] File exists: ...`, the errno's own words."""
    (tmp_path / "afile").write_bytes(b"x")
    path = safetensors(tmp_path / "w.safetensors", {"w": entry()}, bytes(4))
    with pytest.raises(StagingError) as info:
        stage_checkpoint(path, str(tmp_path / "afile" / "store"))
    assert str(info.value) == (f"{tmp_path}/afile/store: cannot make the directory it goes in, "
                               f"{tmp_path}/afile: a path in it is not a directory")
