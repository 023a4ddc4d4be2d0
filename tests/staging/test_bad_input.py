"""Bad checkpoints are refused with one line naming the file and the field: never a traceback,
never exit status 0, never a store claiming what it does not hold."""
import json
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

from prefetchd import _native
from prefetchd.staging import StagingError, iter_checkpoint, read_meta, stage_checkpoint
from ckpt_files import ckpt_value, write_safetensors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F32 = np.arange(6, dtype=np.float32).tobytes()


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def refused(path, store, pattern):
    with pytest.raises(StagingError, match=pattern) as info:
        stage_checkpoint(path, store)
    message = str(info.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert not os.path.exists(store), "a refused stage created the store"
    return message


def test_missing_empty_directory_and_garbage_files(tmp_path):
    store = str(tmp_path / "store")
    refused(str(tmp_path / "nope.ckpt"), store, "no such file")
    refused(str(tmp_path / "nope.safetensors"), store, "no such file")
    os.mkdir(tmp_path / "dir.ckpt")
    refused(str(tmp_path / "dir.ckpt"), store, "is a directory")
    refused(write(tmp_path / "empty.ckpt", b""), store, "file is empty")
    garbage = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    refused(write(tmp_path / "garbage.ckpt", garbage), store, "not a")
    refused(write(tmp_path / "garbage.safetensors", garbage), store, "header length")
    refused(write(tmp_path / "text.safetensors", struct.pack("<Q", 5) + b"hello"), store, "header is not JSON")
    refused(write(tmp_path / "list.safetensors", struct.pack("<Q", 2) + b"[]"), store, "not an object")
    refused(write(tmp_path / "none.safetensors", struct.pack("<Q", 2) + b"{}"), store, "holds no tensors")


@pytest.mark.parametrize("value, field", [
    (ckpt_value("w", [-3, 2], "Float32", F32), r"tensor 'w': dims\[0\] is -3 \(negative\)"),
    (ckpt_value("w", [2, 3], "Float32", F32[:10]), r"tensor 'w': tensor_content holds 10 bytes, dims \[2, 3\] "
                                                   r"of float32 need 24"),
    (ckpt_value("w", [2, 2], "Float32", F32), r"tensor 'w': tensor_content holds 24 bytes, dims \[2, 2\]"),
    (ckpt_value("w", [6], "str", F32), r"tensor 'w': tensor_type 'str' \(a string value\) has no numpy"),
    (ckpt_value("w", [6], "Float8", F32), r"tensor 'w': tensor_type 'Float8' has no numpy"),
    (ckpt_value("w", [6], "Float32", F32) + ckpt_value("v", [1], "Int8", b"x") + ckpt_value("w", [6], "Float32", F32),
     r"tensor 'w' appears twice"),
    (ckpt_value("w", [4, 3], "Float32", F32) + ckpt_value("w", [4, 2], "Float32", F32),
     r"tensor 'w': slice 1 has dims \(4, 2\)"),
    (ckpt_value("w", [4, 3], "Float32", F32) + ckpt_value("v", [1], "Int8", b"x"),
     r"tensor 'w': tensor_content holds 24 bytes, dims \[4, 3\] of float32 need 48"),
    (ckpt_value("w", [2, 3], "Float32", F32) + b"\x1a\x00", r"byte 46: protobuf field 3"),
], ids=["negative-dim", "short-content", "long-content", "string", "unknown-type",
        "duplicate", "slice-dims", "slice-cut-short", "stray-field"])
def test_malformed_ckpt_fields_are_named(tmp_path, ms, value, field):
    refused(write(tmp_path / "bad.ckpt", value), str(tmp_path / "store"), field)


def test_sliced_parameter_pieces_are_concatenated_in_order(tmp_path, ms):
    whole = np.arange(12, dtype=np.float32)
    path = write(tmp_path / "s.ckpt", ckpt_value("w", [4, 3], "Float32", whole[:5].tobytes())
                 + ckpt_value("w", [4, 3], "Float32", whole[5:].tobytes()) + ckpt_value("v", [], "Int8", b"\x07"))
    items = [(n, s, d, bytes(b)) for n, s, d, b in iter_checkpoint(path)]
    assert items == [("w", (4, 3), np.dtype(np.float32), whole.tobytes()), ("v", (), np.dtype(np.int8), b"\x07")]
    # with a crc_num trailer (as crc_check=True writes it): the CRC spans every slice
    body = open(path, "rb").read()
    write(path, body + b"crc_num" + zlib.crc32(body).to_bytes(10, "big"))
    assert [bytes(b) for *_, b in iter_checkpoint(path)] == [whole.tobytes(), b"\x07"]
    write(path, body[:30] + bytes([body[30] ^ 1]) + body[31:] + b"crc_num" + zlib.crc32(body).to_bytes(10, "big"))
    with pytest.raises(StagingError, match="s.ckpt: crc_num trailer says CRC-32"):
        list(iter_checkpoint(path))


@pytest.mark.parametrize("spec, field", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [-4, 4]}, r"tensor 'a': data_offsets \[-4, 4\] is not a range"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, r"tensor 'a': data_offsets \[8, 0\] is not a range"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, r"tensor 'a': shape\[0\] is -2 \(negative\)"),
    ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, r"tensor 'a': shape '2' is not a list"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, r"tensor 'a': data_offsets \[0, 8\] span 8 bytes, "
                                                            r"shape \[3\] of float32 needs 12"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 800]}, r"tensor 'a': data_offsets \[0, 800\] run past"),
    ({"dtype": "F8_E4M3", "shape": [8], "data_offsets": [0, 8]}, r"tensor 'a': dtype 'F8_E4M3' has no numpy"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0]}, r"tensor 'a': data_offsets \[0\] is not a pair"),
    ([1, 2], r"tensor 'a': header entry is not an object"),
])
def test_malformed_safetensors_fields_are_named(tmp_path, spec, field):
    raw = json.dumps({"a": spec}).encode()
    path = write(tmp_path / "bad.safetensors", struct.pack("<Q", len(raw)) + raw + bytes(8))
    refused(path, str(tmp_path / "store"), field)


def test_every_truncation_and_byte_flip_of_a_ckpt_is_refused_or_read_whole(tmp_path, ms):
    """Each prefix of a 3-tensor .ckpt: cut at a value boundary it is a smaller valid checkpoint;
    cut anywhere else it is a StagingError naming the file. Random byte flips: never another exception."""
    values = [ckpt_value("a", [2, 3], "Float32", F32), ckpt_value("bb", [3], "Int16", b"\x01\x00\x02\x00\x03\x00"),
              ckpt_value("c", [], "Float64", struct.pack("<d", 1.5))]
    data = b"".join(values)
    boundaries = {sum(len(v) for v in values[:i]): i for i in range(1, 4)}
    path = str(tmp_path / "cut.ckpt")
    for cut in range(1, len(data) + 1):
        write(path, data[:cut])
        if cut in boundaries:
            assert [t[0] for t in iter_checkpoint(path)] == ["a", "bb", "c"][:boundaries[cut]]
        else:
            with pytest.raises(StagingError, match="cut.ckpt: "):
                list(iter_checkpoint(path))
    rng = np.random.default_rng(7)
    for _ in range(300):
        flipped = bytearray(data)
        for pos in rng.integers(0, len(data), 2):
            flipped[pos] ^= int(rng.integers(1, 256))
        write(path, bytes(flipped))
        try:
            for name, shape, dtype, buf in iter_checkpoint(path):
                assert len(buf) == int(np.prod(shape)) * dtype.itemsize
        except StagingError as e:
            assert str(e).startswith(path) and "\n" not in str(e)


def test_store_entry_without_prefetchd_metadata_is_named(tmp_path):
    store = _native.FileStore(str(tmp_path / "store"))
    try:
        store.write_sync("raw", np.zeros(4, np.uint8), 4, b"not json")
        store.write_sync("liar", np.zeros(4, np.uint8), 4, json.dumps({"shape": [2, 2], "dtype": "float32"}).encode())
        store.write_sync("neg", np.zeros(4, np.uint8), 4, json.dumps({"shape": [-4], "dtype": "uint8"}).encode())
        with pytest.raises(StagingError, match=r"store entry .*raw.*: meta is not prefetchd tensor metadata"):
            read_meta(store.info("raw"))
        with pytest.raises(StagingError, match=r"store entry .*liar.*: holds 4 bytes, meta shape \[2, 2\] of "
                                               r"float32 needs 16"):
            read_meta(store.info("liar"))
        with pytest.raises(StagingError, match=r"store entry .*: meta shape \[-4\] is not a list of non-negative"):
            read_meta(store.info("neg"))
    finally:
        store.close()


@pytest.mark.parametrize("name, content, field", [
    ("missing.ckpt", None, "no such file"),
    ("neg.ckpt", ckpt_value("w", [-3, 2], "Float32", F32), r"tensor 'w': dims[0] is -3"),
    ("trunc.safetensors", "truncate", "tensor 'a': data_offsets [0, 4000] run past the end of the file"),
])
def test_stage_command_refuses_with_one_line_and_a_failing_status(tmp_path, ms, name, content, field):
    path = str(tmp_path / name)
    if content == "truncate":
        write_safetensors(path, {"a": np.ones(1000, np.float32)})
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
    elif content is not None:
        write(path, content)
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "stage", path, "--store", str(tmp_path / "store")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert path in lines[0] and field in lines[0], lines[0]
    assert not os.path.exists(tmp_path / "store")
