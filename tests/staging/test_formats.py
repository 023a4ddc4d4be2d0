"""Real checkpoints: BF16, MindSpore sliced parameters, crc_check=True files."""
import os

import numpy as np
import pytest

from prefetchd import _native
from prefetchd.hooks import register_checkpoint
from prefetchd.staging import (INDEX_FILE, StagingError, iter_checkpoint, read_index, read_meta, stage_checkpoint,
                               verify_checkpoint)
from ckpt_files import bf16_bits, write_safetensors


def read_back(store_dir, name):
    """(array, info) of a staged tensor, read through a FileStore like the daemon does."""
    store = _native.FileStore(store_dir)
    try:
        info = store.info(name)
        shape, dtype = read_meta(info)
        dst = _native.aligned_buffer(max(info["nbytes"], 1))
        store.read_sync(name, dst, True)
        count = int(np.prod(shape)) if shape else 1
        return np.frombuffer(dst, dtype, count).reshape(shape).copy(), info
    finally:
        store.close()


def bf16_params(ms, rng):
    w = rng.standard_normal((48, 32)).astype(np.float32)
    return (ms.Parameter(ms.Tensor(w, ms.bfloat16), name="w"),
            ms.Parameter(ms.Tensor(rng.standard_normal(32).astype(np.float32)), name="b"),
            ms.Parameter(ms.Tensor(np.arange(6, dtype=np.float32).reshape(2, 3), ms.bfloat16), name="s"))


@pytest.mark.parametrize("fmt", ["ckpt", "safetensors"])
def test_bf16_checkpoint_saved_by_mindspore_stages_as_raw_bf16(tmp_path, ms, fmt):
    params = bf16_params(ms, np.random.default_rng(1))
    path = str(tmp_path / f"m.{fmt}")
    ms.save_checkpoint(list(params), path, format=fmt)
    report = stage_checkpoint(path, str(tmp_path / "store"))
    assert report["tensors"] == 3
    assert report["bytes"] == 48 * 32 * 2 + 32 * 4 + 6 * 2
    index = read_index(str(tmp_path / "store"))["tensors"]
    assert index["w"] == {"shape": [48, 32], "dtype": "bfloat16", "nbytes": 48 * 32 * 2}
    for p in params:
        got, info = read_back(str(tmp_path / "store"), p.name)
        assert got.dtype == np.dtype(ms.dtype_to_nptype(p.dtype))
        # the very bits MindSpore holds: no rounding through float32 on the way
        np.testing.assert_array_equal(got.view(np.uint8), p.asnumpy().view(np.uint8))


def test_bf16_safetensors_written_by_hand_carries_the_bits(tmp_path):
    values = np.linspace(-3, 3, 40, dtype=np.float32).reshape(5, 8)
    bits = bf16_bits(values)
    path = str(tmp_path / "h.safetensors")
    write_safetensors(path, {"h": bits}, dtype_names={"h": "BF16"})
    stage_checkpoint(path, str(tmp_path / "store"))
    got, _ = read_back(str(tmp_path / "store"), "h")
    assert got.dtype.name == "bfloat16"
    np.testing.assert_array_equal(got.view(np.uint16), bits)
    np.testing.assert_allclose(got.astype(np.float32), values, rtol=1 / 128)


def test_bf16_model_built_without_weights_computes_from_the_store(tmp_path, ms, make_daemon):
    """A BF16 Parameter made under no_init_parameters, registered via hooks.register_checkpoint, computes
    exactly what the model with its weights in RAM computes."""
    from mindspore import nn, ops
    from mindspore.nn.utils import no_init_parameters

    class Mixed(nn.Cell):          # weights kept in bf16, compute in float32 (CPU MatMul has no bf16)
        def __init__(self, seed=None):
            super().__init__()
            rng = np.random.default_rng(seed)
            self.w = ms.Parameter(ms.Tensor(rng.standard_normal((16, 24)).astype(np.float32), ms.bfloat16),
                                  name="w")
            self.b = ms.Parameter(ms.Tensor(rng.standard_normal(24).astype(np.float32), ms.bfloat16), name="b")

        def construct(self, x):
            return ops.matmul(x, self.w.astype(ms.float32)) + self.b.astype(ms.float32)

    ref = Mixed(seed=3)
    ckpt = str(tmp_path / "mixed.ckpt")
    ms.save_checkpoint(ref, ckpt)
    store = str(tmp_path / "store")
    stage_checkpoint(ckpt, store)
    with no_init_parameters():
        model = Mixed()
    daemon = make_daemon(store_dir=store)
    handles = register_checkpoint(daemon, model)
    assert [h.dtype for h in handles] == [np.dtype(ms.dtype_to_nptype(ms.bfloat16))] * 2
    x = ms.Tensor(np.random.default_rng(5).standard_normal((3, 16)).astype(np.float32))
    with daemon.use(handles):
        assert model.w.dtype == ms.bfloat16
        np.testing.assert_array_equal(model.w.asnumpy().view(np.uint16), ref.w.asnumpy().view(np.uint16))
        np.testing.assert_array_equal(model(x).asnumpy(), ref(x).asnumpy())


@pytest.mark.slow
def test_sliced_parameter_over_512_mib_is_reassembled(tmp_path, ms):
    """mindspore.save_checkpoint stores a > 512 MiB parameter as several same-tag values."""
    rows, cols = 2049, 65536                  # 2049 * 65536 * 4 bytes = 512.25 MiB: two slices
    big = np.empty((rows, cols), np.float32)
    big[:] = np.arange(rows, dtype=np.float32)[:, None]
    big[:, 0] = -1.0
    big[-1, -1] = 7.5
    path = str(tmp_path / "big.ckpt")
    ms.save_checkpoint([ms.Parameter(ms.Tensor(big), name="embedding"),
                        ms.Parameter(ms.Tensor(np.ones(5, np.float32)), name="after")], path)
    del big
    try:
        # the layout this test is about: two values tagged "embedding", each with the full dims
        with open(path, "rb") as f:
            head = f.read(64)
        assert b"embedding" in head
        reader = iter_checkpoint(path)
        assert reader.tensors == 2 and len(reader._entries[0].slices) == 2
        reader.close()
        store = str(tmp_path / "store")
        report = stage_checkpoint(path, store)
    finally:
        os.unlink(path)
    assert report["tensors"] == 2
    assert report["bytes"] == rows * cols * 4 + 20
    got, _ = read_back(store, "embedding")
    assert got.shape == (rows, cols)
    assert (got[:, 0] == -1).all() and got[-1, -1] == 7.5
    np.testing.assert_array_equal(got[:, 1], np.arange(rows, dtype=np.float32))
    np.testing.assert_array_equal(got[1024:1026, 1:5], [[1024] * 4, [1025] * 4])   # across the slice seam
    del got
    np.testing.assert_array_equal(read_back(store, "after")[0], np.ones(5, np.float32))


def test_crc_checked_ckpt_stages_and_a_flipped_byte_is_refused(tmp_path, ms):
    params = bf16_params(ms, np.random.default_rng(2))
    path = str(tmp_path / "crc.ckpt")
    ms.save_checkpoint(list(params), path, crc_check=True)
    store = str(tmp_path / "store")
    assert verify_checkpoint(path) is True
    assert stage_checkpoint(path, store)["tensors"] == 3
    got, _ = read_back(store, "b")
    np.testing.assert_array_equal(got, params[1].asnumpy())

    raw = bytearray(open(path, "rb").read())
    pos = raw.index(params[1].asnumpy().tobytes()) + 5      # inside tensor b's content
    raw[pos] ^= 0x40
    bad = str(tmp_path / "flipped.ckpt")
    with open(bad, "wb") as f:
        f.write(raw)
    before = open(os.path.join(store, INDEX_FILE), "rb").read()
    with pytest.raises(StagingError, match=r"flipped\.ckpt: crc_num .* the file is damaged"):
        verify_checkpoint(bad)
    with pytest.raises(StagingError, match=r"flipped\.ckpt: crc_num .* the file is damaged"):
        stage_checkpoint(bad, store)
    # refused as a whole: the store still holds the good generation
    assert open(os.path.join(store, INDEX_FILE), "rb").read() == before
    np.testing.assert_array_equal(read_back(store, "b")[0], params[1].asnumpy())


def test_crc_checked_safetensors_is_verified(tmp_path, ms):
    params = [ms.Parameter(ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4)), name="x"),
              ms.Parameter(ms.Tensor(np.full(7, 2.5, np.float32)), name="a")]
    path = str(tmp_path / "crc.safetensors")
    ms.save_checkpoint(params, path, format="safetensors", crc_check=True)
    assert stage_checkpoint(path, str(tmp_path / "s1"))["tensors"] == 2
    assert verify_checkpoint(path) is True
    plain = str(tmp_path / "plain.safetensors")
    ms.save_checkpoint(params, plain, format="safetensors")
    assert verify_checkpoint(plain) is False              # nothing to check: says so
    raw = bytearray(open(path, "rb").read())
    raw[-3] ^= 1
    with open(path, "wb") as f:
        f.write(raw)
    with pytest.raises(StagingError, match=r"crc\.safetensors: __metadata__\.crc_num .* damaged"):
        stage_checkpoint(path, str(tmp_path / "s2"))
    assert not os.path.exists(str(tmp_path / "s2"))
