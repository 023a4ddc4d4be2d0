"""An offload() that fails part-way (the store's disk fills up) leaves the model as it was:
every parameter keeps its values and its own memory, the daemon manages none of them,
no file it wrote stays on the disk, and the same model offloads again once there is room.
Before, the parameters placed before the failure stayed managed by the daemon (the model
refused to run, a second offload() was refused as 'already managed') and their files
filled the disk."""
import os

import numpy as np
import pytest

import prefetchd
from prefetchd.errors import StorageError
from _store_helpers import small_fs  # noqa: F401 (a fixture)

H = 256         # 8 blocks of 256 KiB: the 2 MiB filesystem fills up part-way


def _model(ms):
    nn, ops = ms.nn, ms.ops

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([nn.Dense(H, H) for _ in range(8)])

        def construct(self, x):
            for block in self.blocks:
                x = ops.tanh(block(x))
            return x

    ms.set_seed(0)
    return Net()


def _files(d):
    return [f for f in os.listdir(d) if not f.startswith(".")] if os.path.isdir(d) else []


def test_a_failed_offload_leaves_the_model_as_it_was(ms, small_fs, make_daemon, tmp_path):
    model = _model(ms)
    x = ms.Tensor(np.random.default_rng(1).standard_normal((2, H), dtype=np.float32))
    want = model(x).asnumpy()
    values = {p.name: p.asnumpy().copy() for p in model.get_parameters()}
    store = os.path.join(small_fs, "store")      # (small_fs first: unmounted after the daemons close)
    daemon = make_daemon(store_dir=store, device_budget="1MiB")
    with pytest.raises(StorageError, match="ENOSPC"):
        prefetchd.offload(model, daemon, lookahead=1)
    assert daemon.names() == []                           # none managed
    assert _files(store) == []                            # nothing it wrote stays on the disk
    for p in model.get_parameters():                     # each is an ordinary tensor again
        assert prefetchd.tier(p) != ("remote",) and np.array_equal(p.asnumpy(), values[p.name])
    np.testing.assert_array_equal(model(x).asnumpy(), want)
    # the same model offloads once there is room
    roomy = make_daemon(store_dir=str(tmp_path / "roomy"), device_budget="1MiB")
    prefetchd.offload(model, roomy, lookahead=1)
    for _ in range(3):
        np.testing.assert_array_equal(model(x).asnumpy(), want)


@pytest.mark.parametrize("tier", ["host", "remote"])
def test_register_all_places_all_or_none(ms, make_daemon, tmp_path, tier):
    """The third tensor's name is taken by the first: the two placed before it are dropped."""
    first, second = (ms.Parameter(ms.Tensor(np.full((300, 70), v, np.float32)), name=n)
                     for v, n in ((1.0, "a"), (2.0, "b")))
    clash = ms.Parameter(ms.Tensor(np.zeros(5, np.float32)), name="a")
    daemon = make_daemon(store_dir=str(tmp_path / "store"), host_budget="64MiB")
    with pytest.raises(prefetchd.errors.DoubleRegisterError):
        daemon.register_all([first, second, clash], tier=tier)
    assert daemon.names() == [] and _files(str(tmp_path / "store")) == []
    assert daemon.status()["host"]["used"] == 0
    assert first.asnumpy()[0, 0] == 1.0 and second.asnumpy()[0, 0] == 2.0
    handles = daemon.register_all([first, second], tier=tier)     # the names are free again
    assert [h.name for h in handles] == ["a", "b"] and sorted(daemon.names()) == ["a", "b"]
    with daemon.use([first, second]):
        assert first.asnumpy()[299, 69] == 1.0 and second.asnumpy()[0, 0] == 2.0


def test_register_all_refuses_a_single_tensor(ms, make_daemon):
    weight = ms.Parameter(ms.Tensor(np.ones((4, 4), np.float32)), name="w")
    daemon = make_daemon()
    with pytest.raises(TypeError, match="register_all takes an iterable of tensors"):
        daemon.register_all(weight)
    assert daemon.names() == []


def test_a_truncated_store_file_is_named_where_the_tensor_is_missed(ms, tmp_path):
    """A staged tensor file cut short is set aside when the store opens (a WARNING), and
    offload(checkpoint=True) then said only 'the store has no tensor for parameter ...'."""
    from prefetchd.errors import UnknownTensorError
    from prefetchd.staging import stage_checkpoint
    model, ckpt, store = _model(ms), str(tmp_path / "m.ckpt"), str(tmp_path / "store")
    ms.save_checkpoint(model, ckpt)
    stage_checkpoint(ckpt, store)
    victim = max((os.path.join(store, f) for f in os.listdir(store) if f.endswith(".pfd")),
                 key=os.path.getsize)
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) // 2)
    with prefetchd.Daemon(store_dir=store) as daemon:
        with pytest.raises(UnknownTensorError, match=r"set aside 1 unusable file\(s\) when it opened"):
            prefetchd.offload(_model(ms), daemon, checkpoint=True)
