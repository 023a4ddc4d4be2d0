"""The RFC's hierarchical-memory operator cases, translated to CPU.

Device-string checks of the RFC become prefetchd.tier(...) checks.
"""
import numpy as np
import pytest

import prefetchd
from prefetchd import ops
from prefetchd.errors import IntegrityError, NotResidentError, StorageError, UseAfterFreeError

from .conftest import tensor

DTYPES = [np.float32, np.float16, np.int8, np.int64]


# ---------------------------------------------------------------- CopyToDevice / CopyToHost
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_to_device_preserves_shape_dtype_value_and_changes_tier(ms, dtype):
    x = tensor(ms, (np.arange(24) % 100).reshape(2, 3, 4).astype(dtype))
    assert prefetchd.tier(x) == ("host",)
    y = ops.copy_to_device(x)
    assert prefetchd.tier(y) == ("device",)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(y.asnumpy(), x.asnumpy())


def test_copy_to_host_preserves_shape_dtype_value_and_changes_tier(ms):
    x = ops.copy_to_device(tensor(ms, np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)))
    y = ops.copy_to_host(x)
    assert prefetchd.tier(y) == ("host",)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(y.asnumpy(), x.asnumpy())


def test_copy_to_host_then_copy_to_device_round_trips(ms):
    values = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    back = ops.copy_to_device(ops.copy_to_host(ops.copy_to_device(tensor(ms, values))))
    assert prefetchd.tier(back) == ("device",)
    np.testing.assert_array_equal(back.asnumpy(), values)


def test_copies_are_independent_of_their_source(ms):
    x = tensor(ms, np.zeros(4, np.float32))
    y = ops.copy_to_device(x)
    x[0] = 5
    assert y.asnumpy()[0] == 0


def test_primitive_classes_mirror_the_functions(ms):
    x = tensor(ms, np.ones((2, 2), np.float32))
    y = ops.CopyToDevice()(x, False)
    z = ops.CopyToHost()(y, sync=True)
    assert prefetchd.tier(y) == ("device",) and prefetchd.tier(z) == ("host",)
    np.testing.assert_array_equal(z.asnumpy(), x.asnumpy())


def test_result_is_usable_in_compute(ms):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = ops.copy_to_device(tensor(ms, a))
    np.testing.assert_array_equal(ms.ops.matmul(y, tensor(ms, a.T)).asnumpy(), a @ a.T)


# ---------------------------------------------------------------- Free
def test_free_makes_later_use_a_clear_error(ms):
    y = ops.copy_to_device(tensor(ms, np.ones((4, 4), np.float32)))
    ops.free(y)
    assert prefetchd.tier(y) == ()
    with pytest.raises(UseAfterFreeError, match="freed"):
        y.asnumpy()
    with pytest.raises(UseAfterFreeError):
        y + 1
    with pytest.raises(UseAfterFreeError):
        ops.copy_to_host(y)
    # A kernel that receives it directly sees a 0-element tensor: a shape error, not garbage.
    with pytest.raises((ValueError, RuntimeError, TypeError)):
        ms.ops.matmul(tensor(ms, np.ones((4, 4), np.float32)), y).asnumpy()


def test_a_freed_or_detached_unnamed_tensor_says_which_it_is(ms):
    # Their repr said "<prefetchd tensor None: not resident>": no name to find it by.
    freed = ops.copy_to_device(tensor(ms, np.ones(3, np.float32)))
    ops.free(freed)
    detached = ops.update_to_remote(ops.copy_to_device(tensor(ms, np.ones(3, np.float32))))
    ops.detach(detached)
    for x in (freed, detached):
        assert f"tensor@{id(x):x}" in repr(x) and "None" not in repr(x), repr(x)


def test_double_free_is_an_error(ms):
    y = ops.copy_to_device(tensor(ms, np.ones(3, np.float32)))
    ops.Free()(y)
    with pytest.raises(UseAfterFreeError, match="already freed"):
        ops.free(y)


def test_free_returns_device_memory(ms):
    rt = ops.runtime()
    y = ops.copy_to_device(tensor(ms, np.ones(1 << 20, np.float32)))
    used = rt.device.used
    ops.free(y)
    assert rt.device.used <= used - (4 << 20)


def test_free_waits_for_pending_compute(ms):
    """MindSpore runs ops asynchronously: free() must not release memory a queued kernel reads."""
    a = np.random.default_rng(1).standard_normal((512, 512)).astype(np.float32)
    w = ops.copy_to_device(tensor(ms, a))
    x = tensor(ms, a)
    outs = [ms.ops.matmul(x, w) for _ in range(8)]
    ops.free(w)
    junk = ops.copy_to_device(tensor(ms, np.full((512, 512), 7, np.float32)))  # may reuse w's block
    expect = a @ a
    for out in outs:
        np.testing.assert_allclose(out.asnumpy(), expect, rtol=1e-4, atol=1e-3)
    assert junk.asnumpy()[0, 0] == 7


# ---------------------------------------------------------------- SetData
def test_set_data_x_follows_a(ms):
    a = tensor(ms, np.arange(4, dtype=np.float32))
    x = tensor(ms, np.zeros(4, np.float32))
    ops.set_data(x, a)
    np.testing.assert_array_equal(x.asnumpy(), a.asnumpy())


def test_set_data_inplace_change_to_a_is_seen_through_x(ms):
    a = ops.copy_to_device(tensor(ms, np.arange(4, dtype=np.float32)))
    x = tensor(ms, np.zeros(4, np.float32))
    ops.SetData()(x, a)
    a[1] = 50                                     # slice assignment: a real in-place write
    assert x.asnumpy()[1] == 50
    assert prefetchd.tier(x) == ("device",)


@pytest.mark.parametrize("let_go", ["free x", "free value", "detach x", "update_to_device x"])
def test_storage_shared_by_set_data_lives_until_the_last_tensor_lets_go(ms, let_go):
    """free/detach/update_to_device through one of two tensors sharing a block released it
    under the other: it read the next tensor's values, and its writes landed there."""
    rt = ops.runtime()
    value = ops.copy_to_device(tensor(ms, np.arange(1024, dtype=np.float32)))
    x = tensor(ms, np.zeros(1024, np.float32))
    ops.set_data(x, value)
    who, survivor = (value, x) if let_go == "free value" else (x, value)
    if let_go.startswith("free"):
        ops.free(who)
    else:
        ops.update_to_remote(who)
        ops.detach(who) if let_go == "detach x" else ops.update_to_device(who)
    used = rt.device.used
    other = ops.copy_to_device(tensor(ms, np.full(1024, -1, np.float32)))
    with_other = rt.device.used
    assert with_other > used                             # a block of its own, not the shared one
    np.testing.assert_array_equal(survivor.asnumpy(), np.arange(1024, dtype=np.float32))
    survivor[0] = 555
    np.testing.assert_array_equal(other.asnumpy(), np.full(1024, -1, np.float32))
    assert prefetchd.tier(survivor)[0] == "device"
    ops.free(survivor)                                   # the last one: the block goes now
    assert rt.device.used == with_other - 4096


def test_set_data_changes_through_both_are_seen_by_both(ms):
    a = tensor(ms, np.zeros(4, np.float32))
    x = tensor(ms, np.ones(4, np.float32))
    ops.set_data(x, a)
    a[0] = 3
    x[2] = 7
    x.copy_(x + 1)
    np.testing.assert_array_equal(a.asnumpy(), [4, 1, 8, 1])
    np.testing.assert_array_equal(x.asnumpy(), a.asnumpy())


def test_mindspore_add_inplace_is_still_a_silent_noop_on_cpu(ms):
    """Pins MindSpore 2.10 behaviour the SetData tests work around (docs/mindspore-notes.md).

    If this fails, Tensor.add_ started working: the SetData tests may use it.
    """
    t = tensor(ms, np.ones(3, np.float32))
    t.add_(1)
    np.testing.assert_array_equal(t.asnumpy(), [1, 1, 1])


# ---------------------------------------------------------------- UpdateToRemote / Detach / UpdateToDevice
SIZES = [1, 3, 4095, 4096, 4097, 1 << 20, (1 << 20) + 12345]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nbytes", SIZES)
def test_remote_round_trip_is_bit_exact(ms, dtype, nbytes):
    itemsize = np.dtype(dtype).itemsize
    count = max(1, nbytes // itemsize)
    rng = np.random.default_rng(nbytes)
    values = rng.integers(0, 255, count * itemsize, dtype=np.uint8).view(dtype)
    x = ops.copy_to_device(tensor(ms, values))
    ops.update_to_remote(x)
    assert prefetchd.tier(x) == ("device", "remote")
    ops.detach(x)
    assert prefetchd.tier(x) == ("remote",)
    with pytest.raises(NotResidentError):
        x.asnumpy()
    ops.update_to_device(x)
    assert prefetchd.tier(x) == ("device", "remote")
    assert x.asnumpy().tobytes() == values.tobytes()


@pytest.mark.slow
def test_remote_round_trip_256_mib(ms):
    values = np.random.default_rng(7).integers(0, 2**31, (256 << 20) // 4, dtype=np.int64).astype(np.float32)
    x = ops.copy_to_device(tensor(ms, values))
    del values
    expected_crc = prefetchd._native.crc32c(x.asnumpy())
    ops.update_to_remote(x)
    ops.detach(x)
    ops.update_to_device(x)
    assert prefetchd._native.crc32c(x.asnumpy()) == expected_crc


def test_detach_without_remote_replica_refuses_and_loses_nothing(ms):
    x = ops.copy_to_device(tensor(ms, np.arange(10, dtype=np.float32)))
    with pytest.raises(StorageError, match="no remote replica"):
        ops.detach(x)
    assert prefetchd.tier(x) == ("device",)
    np.testing.assert_array_equal(x.asnumpy(), np.arange(10))


def test_detach_after_a_write_refuses_because_remote_is_stale(ms):
    x = ops.copy_to_device(tensor(ms, np.zeros(8, np.float32)))
    ops.update_to_remote(x)
    x[3] = 9
    with pytest.raises(StorageError, match="stale"):
        ops.Detach()(x)
    assert x.asnumpy()[3] == 9


def test_update_to_device_without_remote_replica_is_an_error(ms):
    x = ops.copy_to_device(tensor(ms, np.zeros(8, np.float32)))
    with pytest.raises(NotResidentError, match="no remote replica"):
        ops.UpdateToDevice()(x)


def test_corrupted_remote_file_is_detected_on_read(ms):
    values = np.arange(100_000, dtype=np.float32)
    x = ops.copy_to_device(tensor(ms, values))
    ops.UpdateToRemote()(x)
    ops.detach(x)
    path = ops.runtime().store.info(ops._entry(x).remote_key)["path"]
    with open(path, "r+b") as f:                      # flip one byte in the data region
        f.seek(-4096 - 17, 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    with pytest.raises(IntegrityError, match="(?i)checksum"):   # as the daemon's loads say it
        ops.update_to_device(x)
    assert prefetchd.tier(x) == ("remote",)           # still detached, nothing half-loaded


def test_failed_write_leaves_device_replica_intact_and_reports(ms):
    from prefetchd import _native
    x = ops.copy_to_device(tensor(ms, np.arange(50_000, dtype=np.float32)))
    _native.inject_fault("write", "error", nth=1, err=28)   # ENOSPC
    try:
        with pytest.raises(StorageError, match="ENOSPC"):
            ops.update_to_remote(x)
    finally:
        _native.clear_faults()
    assert prefetchd.tier(x) == ("device",)
    np.testing.assert_array_equal(x.asnumpy(), np.arange(50_000))
    with pytest.raises(StorageError, match="no remote replica"):
        ops.detach(x)


def test_what_is_not_a_tensor_is_refused_by_name(ms):
    for call in (lambda: ops.free(None), lambda: ops.copy_to_device(np.zeros(3)),
                 lambda: ops.set_data(tensor(ms, np.zeros(3, np.float32)), np.zeros(3, np.float32)),
                 lambda: prefetchd.tier(None), lambda: prefetchd.tier(np.zeros(3))):
        with pytest.raises(TypeError, match="mindspore Tensor or Parameter, not (NoneType|ndarray)"):
            call()


def test_a_full_device_tier_is_a_budget_error_not_a_native_one(ms):
    rt = ops.runtime()
    big = np.zeros(rt.device.capacity // 4 + 1, np.float32)
    kept = []
    with pytest.raises(prefetchd.BudgetError, match="no room for .* bytes in the device tier"):
        for _ in range(8):
            kept.append(ops.copy_to_device(tensor(ms, big)))
    for t in kept:
        ops.free(t)


def test_tier_drops_a_remote_replica_the_tensor_has_changed_since(ms):
    y = ops.copy_to_device(tensor(ms, np.arange(16, dtype=np.float32)))
    ops.update_to_remote(y)
    assert prefetchd.tier(y) == ("device", "remote")
    y[3] = 99
    assert prefetchd.tier(y) == ("device",)
    ops.update_to_remote(y)
    assert prefetchd.tier(y) == ("device", "remote")


@pytest.mark.parametrize("op", ["free", "detach", "update_to_remote", "update_to_device", "set_data"])
def test_in_place_operators_refuse_a_weight_a_daemon_manages(ms, make_daemon, op):
    """ops.free(w) on an offloaded model's weight was accepted: it bound the weight to an
    empty buffer behind the daemon's back, and every later forward failed with a shape
    error. The in-place operators now refuse it, and the model runs as before."""
    from prefetchd.errors import PrefetchdError
    ms.set_seed(3)
    model = ms.nn.SequentialCell([ms.nn.Dense(32, 32) for _ in range(4)])
    x = tensor(ms, np.random.default_rng(3).standard_normal((2, 32)).astype(np.float32))
    want = model(x).asnumpy()
    prefetchd.offload(model, make_daemon(device_budget=3 * 32 * 33 * 4 + (1 << 14)), lookahead=1)
    model(x)
    weight = model[1].weight
    call = {"set_data": lambda: ops.set_data(weight, tensor(ms, np.zeros((32, 32), np.float32)))}.get(
        op, lambda: getattr(ops, op)(weight))
    with pytest.raises(PrefetchdError, match=f"{op}: tensor '1.weight' is managed by a prefetchd Daemon"):
        call()
    for _ in range(2):
        np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_the_refusal_names_a_tensor_registered_by_hand(ms, make_daemon):
    """It was called '?' (a tensor's own name is empty; the daemon's is the one to give)."""
    from prefetchd.errors import PrefetchdError
    daemon = make_daemon()
    for tier in ("device", "host", "remote"):
        t = tensor(ms, np.ones((16, 16), np.float32))
        daemon.register(t, name=f"t_{tier}", tier=tier)
        with pytest.raises(PrefetchdError, match=f"free: tensor 't_{tier}' is managed"):
            ops.free(t)
