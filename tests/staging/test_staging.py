"""Staging checkpoints into the remote tier, and models built straight from a store."""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import prefetchd
from prefetchd import _native
from prefetchd.demo.model import build_model, make_inputs
from prefetchd.staging import INDEX_FILE, CheckpointError, stage_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        dtype = {"float32": "F32", "float16": "F16", "int64": "I64", "int8": "I8"}[array.dtype.name]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def test_stage_cli_imports_a_mindspore_ckpt_and_the_model_runs_from_the_store(tmp_path, ms, make_daemon):
    ref = build_model(128, 3, seed=4)
    ckpt = str(tmp_path / "model.ckpt")
    ms.save_checkpoint(ref, ckpt)
    store = str(tmp_path / "store")
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "stage", ckpt, "--store", store, "--json"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    params = list(ref.get_parameters())
    assert report["tensors"] == len(params)
    assert report["bytes"] == sum(p.asnumpy().nbytes for p in params)
    index = json.load(open(os.path.join(store, INDEX_FILE)))["tensors"]
    assert index["blocks.0.qkv.weight"]["shape"] == [384, 128]

    model = build_model(128, 3, materialize=False)          # no weights in RAM
    daemon = make_daemon(store_dir=store, device_budget="2MiB")
    prefetchd.offload(model, daemon, lookahead=1, checkpoint=True, auto_fetch=True)
    x = make_inputs(2, 4, 128)
    np.testing.assert_array_equal(model(x).asnumpy(), ref(x).asnumpy())


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.int8])
def test_safetensors_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    tensors = {f"t{i}": (rng.standard_normal((3, 5 + i)) * 10).astype(dtype) for i in range(4)}
    path = str(tmp_path / "w.safetensors")
    write_safetensors(path, tensors)
    report = stage_checkpoint(path, str(tmp_path / "store"))
    assert report["tensors"] == 4
    store = _native.FileStore(str(tmp_path / "store"))
    try:
        for name, array in tensors.items():
            dst = _native.aligned_buffer(array.nbytes)
            store.read_sync(name, dst, True)
            np.testing.assert_array_equal(np.frombuffer(dst, array.dtype, array.size).reshape(array.shape), array)
    finally:
        store.close()


def test_checkpoint_staged_by_offload_itself(tmp_path, ms, make_daemon):
    ref = build_model(64, 2, seed=8)
    ckpt = str(tmp_path / "m.ckpt")
    ms.save_checkpoint(ref, ckpt)
    model = build_model(64, 2, materialize=False)
    prefetchd.offload(model, make_daemon(), lookahead=1, checkpoint=ckpt, auto_fetch=True)
    x = make_inputs(1, 2, 64)
    np.testing.assert_array_equal(model(x).asnumpy(), ref(x).asnumpy())


def test_truncated_and_unknown_checkpoints_are_clear_errors(tmp_path):
    path = str(tmp_path / "bad.safetensors")
    write_safetensors(path, {"a": np.ones(1000, np.float32)})
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError, match="'a'"):
        stage_checkpoint(path, str(tmp_path / "s1"))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CheckpointError, match="header length"):
        stage_checkpoint(path, str(tmp_path / "s2"))
    with pytest.raises(CheckpointError, match="unknown checkpoint format"):
        stage_checkpoint(__file__, str(tmp_path / "s3"))
    with pytest.raises(CheckpointError, match="no such file"):
        stage_checkpoint(str(tmp_path / "missing.ckpt"), str(tmp_path / "s4"))


def test_staging_holds_one_tensor_at_a_time_not_the_model(tmp_path):
    """Stage 256 MiB (16 MiB tensors) in a fresh process: its peak RSS stays far below that
    (a reader that loads the file, or the model, into memory would not)."""
    path = str(tmp_path / "big.safetensors")
    write_safetensors(path, {f"w{i}": np.full(4 << 20, i, np.float32) for i in range(16)})
    code = ("import resource, sys; from prefetchd.staging import stage_checkpoint; "
            "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; "
            "stage_checkpoint(sys.argv[1], sys.argv[2]); "
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)")
    out = subprocess.run([sys.executable, "-c", code, path, str(tmp_path / "store")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    growth = int(out.stdout.strip())
    assert growth < 96 << 20, f"staging 256 MiB grew RSS by {growth / 2**20:.0f} MiB"
