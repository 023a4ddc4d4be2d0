"""The shared host tier with real processes: an owner process and daemon processes
attached to it over its Unix socket, each with its own store of hard links to one
staged store (as `prefetchd serve` workers have)."""
import os
import signal
import time

import pytest

from helpers import wait_until
from procs import Child, Owner, link_store, proc_numbers, stage

MiB = 1 << 20
TENSORS = {f"layer{i}.weight": [i, MiB] for i in range(16)}     # 16 x 4 MiB float32
MODEL = sum(count * 4 for _, count in TENSORS.values())           # 64 MiB
DEVICE = MODEL // 4                                               # each daemon holds a quarter


@pytest.fixture
def staged(tmp_path):
    return str(tmp_path), stage(str(tmp_path), TENSORS)


def _children(root, src, owner, n, rounds, tensors=TENSORS):
    return [Child(link_store(src, os.path.join(root, f"w{i}")), owner.socket if owner else None,
                  tensors, DEVICE, rounds) for i in range(n)]


def test_four_daemons_read_the_disk_once_and_hold_one_host_copy(staged):
    root, src = staged
    owner = Owner(root, src, 2 * MODEL)
    children = _children(root, src, owner, 4, rounds=2)
    try:
        owner_before = proc_numbers(owner.proc.pid)
        ready = [c.expect("ready") for c in children]
        done = [c.expect("done", timeout=120) for c in children]
        owner_after = proc_numbers(owner.proc.pid)
        status = owner.status()
        after = [proc_numbers(c.proc.pid) for c in children]
    finally:
        for c in children:
            c.finish()
        rc, err = owner.stop()
    assert rc == 0, err
    # Bit-equal to the values written, every load of every daemon.
    assert [d["wrong"] for d in done] == [0] * 4
    assert [d["loads"] for d in done] == [2 * len(TENSORS)] * 4
    # The disk was read once in total: by the owner, one fill per tensor.
    assert status["counters"]["fills"] == len(TENSORS)
    assert status["counters"]["fill_bytes"] == MODEL
    owner_read = owner_after[0] - owner_before[0]
    workers_read = sum(a[0] - r["read_bytes"] for a, r in zip(after, ready))
    print(f"\nread_bytes: owner {owner_read}, workers {workers_read}, model {MODEL}")
    assert MODEL <= owner_read <= 1.1 * MODEL
    assert workers_read <= MODEL // 16
    assert [d["shared"]["fallbacks"] for d in done] == [0] * 4
    # One acquire per tensor: the owner's budget holds the whole store, so a dropped
    # tensor's mapping stays parked under its home and the second round unparks it.
    assert [d["shared"]["hits"] for d in done] == [len(TENSORS)] * 4
    # One host copy: what the owner and the daemons gained over their start-up sizes.
    gained = (owner_after[1] - owner_before[1]) + sum(a[1] - r["pss"] for a, r in zip(after, ready))
    bound = 1.2 * (MODEL + 4 * DEVICE)
    print(f"PSS gained: {gained / MiB:.1f} MiB (owner {(owner_after[1] - owner_before[1]) / MiB:.1f}); "
          f"bound {bound / MiB:.1f} MiB; private host tiers would hold {4 * MODEL / MiB:.0f} MiB of replicas")
    assert gained <= bound
    # Each daemon still holds a lease per tensor whose mapping is parked under its home
    # (the owner's budget covers the store), and nothing more.
    assert [d["shared"]["parked_leases"] for d in done] == [len(TENSORS)] * 4
    assert status["leases"] == sum(d["shared"]["mapped_leases"] for d in done)


def test_private_host_tiers_of_the_same_run_hold_a_copy_each(staged):
    """The measure above can fail: the same four daemons with private host tiers (the
    default) read the disk four times and hold four copies."""
    root, src = staged
    children = [Child(link_store(src, os.path.join(root, f"p{i}")), None, TENSORS, DEVICE, 2,
                      host_budget=2 * MODEL) for i in range(4)]
    try:
        ready = [c.expect("ready") for c in children]
        done = [c.expect("done", timeout=120) for c in children]
        after = [proc_numbers(c.proc.pid) for c in children]
    finally:
        for c in children:
            c.finish()
    assert [d["wrong"] for d in done] == [0] * 4
    read = sum(a[0] - r["read_bytes"] for a, r in zip(after, ready))
    gained = sum(a[1] - r["pss"] for a, r in zip(after, ready))
    print(f"\nprivate: read_bytes {read}, PSS gained {gained / MiB:.1f} MiB")
    assert read >= 4 * MODEL
    assert gained > 1.2 * (MODEL + 4 * DEVICE)


def test_sigkill_of_daemons_mid_load_leaks_no_lease_and_survivors_keep_serving(staged):
    root, src = staged
    owner = Owner(root, src, 2 * MODEL)
    survivors = _children(root, src, owner, 3, rounds=6)
    killed = []
    try:
        for c in survivors:
            c.expect("ready")
        for i in range(5):          # bounded: five daemons killed while they load
            victim = Child(link_store(src, os.path.join(root, f"k{i}")), owner.socket, TENSORS, DEVICE, 0)
            victim.expect("ready")
            time.sleep(0.05 + 0.1 * i)
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(10)
            killed.append(victim)
        done = [c.expect("done", timeout=180) for c in survivors]
        # Every killed daemon's connection is gone, and with it its leases.
        assert wait_until(lambda: len(owner.status()["workers"]) == 3 + 1, timeout=10)
        status = owner.status()
    finally:
        for c in survivors:
            c.finish()
        rc, err = owner.stop()
    assert rc == 0, err
    assert [d["wrong"] for d in done] == [0] * 3
    assert [d["loads"] for d in done] == [6 * len(TENSORS)] * 3
    assert [d["shared"]["fallbacks"] for d in done] == [0] * 3
    # The survivors' leases (their parked mappings: a covering budget) and not one more.
    assert status["leases"] == sum(d["shared"]["mapped_leases"] for d in done) > 0
    assert status["counters"]["detached"] >= 5
    assert status["counters"]["fills"] == len(TENSORS)    # nothing lost: no block refilled
    assert status["counters"]["fill_errors"] == 0


def test_a_corrupted_tensor_fails_closed_and_the_others_keep_loading(staged, tmp_path):
    from _store_helpers import data_offset, flip_byte
    from prefetchd import _native
    root, src = staged
    bad = "layer3.weight"
    store = _native.FileStore(src)
    path, nbytes = store.info(bad)["path"], store.info(bad)["nbytes"]
    store.close()
    flip_byte(path, data_offset(path, nbytes) + 12345)   # the inode every store links to
    owner = Owner(root, src, 2 * MODEL)
    try:
        child = Child(link_store(src, os.path.join(root, "bad")), owner.socket,
                      {bad: TENSORS[bad]}, DEVICE, 1)
        child.expect("ready")
        child.proc.stdin.close()
        child.proc.wait(60)
        err = child.proc.stderr.read()
        good = _children(root, src, owner, 1, rounds=1,
                         tensors={k: v for k, v in TENSORS.items() if k != bad})[0]
        good.expect("ready")
        done = good.expect("done", timeout=120)
        good.finish()
        status = owner.status()
    finally:
        rc, owner_err = owner.stop()
    # The owner's checksummed read refused it, so did the daemon's own read: the load
    # failed with a checksum error, no bytes of it were ever used.
    assert child.proc.returncode != 0
    assert "checksum" in err.lower(), err[-2000:]
    assert status["counters"]["fill_errors"] >= 1
    assert status["counters"]["refused_io_error"] >= 1
    assert done["wrong"] == 0 and done["shared"]["fallbacks"] == 0
    assert status["leases"] == 0
