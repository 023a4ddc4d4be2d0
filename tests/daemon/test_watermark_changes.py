"""set_watermarks while the device tier holds more than the new high watermark: the old
watermarks stay in force (and reported) until the bytes in use are under the new ones,
so `used <= high_watermark` holds in every status a watcher reads; the request resolves
then, or fails with BudgetError naming what holds the bytes (the old ones staying).
Before, a lowering resolved at once while dirty victims were still being written back,
and status showed used above the high watermark (the watermark alert fired)."""
import threading

import numpy as np
import pytest

from prefetchd.errors import BudgetError

KiB = 1024


def _dirty_daemon(make_daemon, ms, n=6):
    daemon = make_daemon(device_budget="4MiB")
    tensors = [ms.Tensor(np.full(128 * KiB, i, np.float32)) for i in range(n)]   # 512 KiB each
    for i, t in enumerate(tensors):
        daemon.register(t, f"w{i}")                # on the device tier: dirty until written back
    return daemon, tensors


def test_a_lowering_resolves_once_the_device_tier_is_under_it(make_daemon, ms):
    daemon, _ = _dirty_daemon(make_daemon, ms)
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            device = daemon.status()["device"]
            seen.append((device["used"], device["high_watermark"]))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in range(5):
            daemon.set_watermarks("1MiB", "512KiB").result(30)
            device = daemon.status()["device"]
            assert device["used"] <= device["high_watermark"] == 1 << 20, device
            daemon.set_watermarks(1.0, 0.9).result(30)
            for i in range(6):
                with daemon.use([f"w{i}"]):
                    pass
                daemon.mark_dirty([f"w{i}"])       # so the next lowering writes them back again
    finally:
        stop.set()
        watcher.join(10)
    over = [(used, high) for used, high in seen if used > high]
    assert len(seen) > 100 and not over, f"{len(over)} of {len(seen)} statuses had used > high: {over[:3]}"


def test_a_lowering_that_cannot_be_reached_fails_and_keeps_the_old_watermarks(make_daemon, ms, native_faults):
    """A victim whose write-back fails stays resident (nothing is lost): with nothing else in
    flight the new high watermark cannot be reached, so the change fails, saying why."""
    daemon, tensors = _dirty_daemon(make_daemon, ms, n=4)
    before = daemon.status()["device"]
    native_faults.inject_fault("write", "error", nth=1, count=1000, err=28, key_contains="w")   # ENOSPC
    with pytest.raises(BudgetError, match=r"cannot be reached: .* held because their write-back failed \('w.*ENOSPC.*as does flush\(\)"):
        daemon.set_watermarks("1MiB", "512KiB").result(30)
    device = daemon.status()["device"]
    assert (device["high_watermark"], device["low_watermark"]) == (before["high_watermark"], before["low_watermark"])
    assert device["used"] <= device["high_watermark"]
    native_faults.clear_faults()
    daemon.flush().result(30)                              # the disk is back: the retried write-backs land
    daemon.set_watermarks("1MiB", "512KiB").result(30)     # and the lowering is reached
    for i, t in enumerate(tensors):
        with daemon.use([f"w{i}"]):
            assert (t.asnumpy() == i).all()


def test_a_change_made_while_one_is_under_way_settles_both(make_daemon, ms):
    """The earlier request failed as 'superseded' (the random-interleavings test caught it: two
    threads setting the same watermarks). It now settles with the later change."""
    daemon, _ = _dirty_daemon(make_daemon, ms)
    first = daemon.set_watermarks("1MiB", "512KiB")
    second = daemon.set_watermarks(1.0, 0.9)
    second.result(30)
    first.result(30)
    device = daemon.status()["device"]
    assert device["high_watermark"] == 4 << 20 and device["used"] <= device["high_watermark"]
