"""Faults: crash-safe write-back, injected I/O errors, corruption, and what survives them."""
import os
import random
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from prefetchd import _native
from prefetchd.errors import IntegrityError, StorageError
from prefetchd.core.records import State

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the crash writer lives in tests/
sys.path.insert(0, TESTS)
from _crash_writer import size_of, value  # noqa: E402
from helpers import ENV  # noqa: E402

MiB = 1 << 20


pytestmark = pytest.mark.usefixtures("native_faults")     # no injected fault outlives a test


# ---------------------------------------------------------------- crash safety
def _pfd_files_by_key(directory, keys):
    """{key: [(store version, path)] oldest first} of the version files on disk."""
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".pfd"):
            key = int(name.split("-")[0][1:])          # "t3-<hash>.<version>.pfd"
            out.setdefault(key, []).append((int(name.split(".")[-2], 16), os.path.join(directory, name)))
    return {k: sorted(v) for k, v in out.items() if k < keys}


def _flip_data_byte(path, nbytes):
    at = os.path.getsize(path) - (-(-nbytes // 4096) * 4096) + nbytes // 2   # middle of the data
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def _kill_loop(tmp_path, verify, max_iterations, seconds, seed):
    """Run the crash writer, SIGKILL it at random points, reopen and check every key.

    Returns (iterations, how many kills landed in a verify window whose new
    version was then corrupted on disk)."""
    directory, keys = str(tmp_path / "store"), 6
    os.makedirs(directory)
    rng = random.Random(seed)
    # acked: last acknowledged version per key; unacked: versions begun since
    # that ack whose fate is unknown (a write can land and the kill come
    # before its ack is printed) — on disk must be one of these.
    acked, unacked, version = {}, {}, 0
    deadline = time.monotonic() + seconds
    iterations = corrupted_windows = 0
    while iterations < max_iterations and time.monotonic() < deadline:
        child = subprocess.Popen([sys.executable, os.path.join(TESTS, "_crash_writer.py"),
                                  directory, str(keys), str(rng.randrange(1 << 30)), str(version)]
                                 + (["verify"] if verify else []),
                                 stdout=subprocess.PIPE, text=True, env=ENV)
        lines, writing = [], threading.Event()

        def read_lines():
            for line in child.stdout:
                lines.append(line)
                writing.set()
        reader = threading.Thread(target=read_lines, daemon=True)
        reader.start()
        writing.wait(30)                           # the interpreter started and the first write began
        time.sleep(rng.random() * 0.15)            # then it writes for a while
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        reader.join(10)
        for line in lines:
            kind, key, v = line.split()
            key, v = int(key), int(v)
            version = max(version, v + 1)
            if kind == "begin":
                unacked.setdefault(key, set()).add(v)
            else:
                acked[key] = v
                unacked.pop(key, None)
        # Killed between a write and its verify read: the previous version is
        # still on disk. Corrupt the new one (bit rot, a lying disk): recovery
        # must come back with the previous, acknowledged version.
        window = {}
        if verify:
            for key, on_disk in _pfd_files_by_key(directory, keys).items():
                if len(on_disk) >= 2:
                    assert key in acked, f"t{key}: two versions on disk but none acknowledged"
                    _flip_data_byte(on_disk[-1][1], size_of(key))
                    window[key] = on_disk[-1][1]
            corrupted_windows += len(window)
        store = _native.FileStore(directory)        # recovery runs here
        try:
            quarantined = {q["path"]: q["reason"] for q in store.quarantined}
            for key in range(keys):
                allowed = {acked[key]} if key in window else {acked.get(key)} | unacked.get(key, set())
                allowed.discard(None)
                if not store.contains(f"t{key}"):
                    assert key not in acked, f"t{key}: acknowledged version {acked[key]} lost"
                    continue
                dst = _native.aligned_buffer(size_of(key))
                store.read_sync(f"t{key}", dst, True)           # checksum-verified
                got = np.frombuffer(dst, np.uint8, size_of(key))
                got_version = int(np.frombuffer(got[:8].tobytes(), np.int64)[0])
                assert got_version in allowed, (f"t{key}: read version {got_version}, "
                                                f"acknowledged {acked.get(key)}, unacknowledged "
                                                f"{sorted(unacked.get(key, ()))}, corrupted window {key in window}")
                if key in window:
                    assert quarantined.get(window[key], "").startswith("checksum mismatch"), quarantined
                    unacked.pop(key, None)            # that write is gone for good
                if got_version != acked.get(key):     # an unacknowledged write landed: now the truth
                    acked[key] = got_version
                    unacked.pop(key, None)
                np.testing.assert_array_equal(got, value(key, got_version, size_of(key)))
            assert not [f for f in os.listdir(directory) if f.endswith(".tmp")], "recovery left torn files"
            assert all(len(v) == 1 for v in _pfd_files_by_key(directory, keys).values()), "old versions left"
        finally:
            store.close()
        iterations += 1
    assert acked, "the writer never acknowledged a write"
    return iterations, corrupted_windows


def test_sigkill_at_random_points_never_loses_an_acknowledged_write(tmp_path):
    """Kill a writer with SIGKILL at random points, hundreds of times; after each
    kill, reopening the store (recovery) must give every key at its last
    acknowledged version or at the one in flight — intact by checksum."""
    iterations, _ = _kill_loop(tmp_path, verify=False, max_iterations=150, seconds=120, seed=20261130)
    assert iterations >= 100, f"only {iterations} kill iterations ran in the time bound"


def test_sigkill_before_verify_with_a_corrupt_new_version_recovers_the_old_one(tmp_path):
    """The writer verifies each write like the daemon does; kills that land
    between a write and its verify read leave the new version unverified.
    Corrupting that new version on disk must not lose the tensor: recovery
    quarantines it and serves the last acknowledged (verified) version."""
    iterations, windows = _kill_loop(tmp_path, verify=True, max_iterations=80, seconds=80, seed=13)
    assert iterations >= 40, f"only {iterations} kill iterations ran in the time bound"
    assert windows >= 10, f"only {windows} kills landed between a write and its verify read"


def test_recovery_reports_torn_writes(tmp_path):
    d = str(tmp_path)
    store = _native.FileStore(d)
    store.write_sync("a", np.ones(5000, np.uint8), -1, b"")
    store.close()
    torn = os.path.join(d, "a-deadbeef.0000000000000009.tmp")
    with open(torn, "wb") as f:
        f.write(b"PFD1" + b"\0" * 100)
    store = _native.FileStore(d)
    try:
        assert any(p.endswith(".tmp") for p in store.recovery_report["removed_tmp"])
        assert store.contains("a") and not os.path.exists(torn)
    finally:
        store.close()


# ---------------------------------------------------------------- injected faults through the daemon
def _two(daemon, make_param, n=MiB // 4):
    a = daemon.register(make_param(np.full(n, 1, np.float32), "victim.a"), tier="remote")
    b = daemon.register(make_param(np.full(n, 2, np.float32), "other.b"), tier="remote")
    return a, b


def _assert_other_still_fine(daemon, b):
    daemon.prefetch(b).result(10)
    with daemon.use(b):
        assert b.target.asnumpy()[0] == 2 and b.target.asnumpy()[-1] == 2


@pytest.mark.parametrize("err, name", [(5, "EIO"), (28, "ENOSPC")])
def test_read_error_fails_that_tensor_only(daemon, make_param, err, name):
    a, b = _two(daemon, make_param)
    _native.inject_fault("read", "error", nth=1, err=err, key_contains="victim")
    with pytest.raises(StorageError, match=name):
        daemon.prefetch(a).result(10)
    assert a.state is State.ABSENT and daemon.stats.io_errors["read"] == 1
    _assert_other_still_fine(daemon, b)
    daemon.prefetch(a).result(10)                   # the fault was one-shot: it loads now
    with daemon.use(a):
        assert a.target.asnumpy()[0] == 1


def test_short_read_is_an_error_not_garbage(daemon, make_param):
    a, b = _two(daemon, make_param)
    _native.inject_fault("read", "short", nth=1, key_contains="victim")
    with pytest.raises(StorageError, match="(?i)short"):
        daemon.prefetch(a).result(10)
    _assert_other_still_fine(daemon, b)


def test_bitflip_is_caught_by_the_checksum(daemon, make_param):
    a, b = _two(daemon, make_param)
    _native.inject_fault("read", "bitflip", nth=1, key_contains="victim")
    with pytest.raises(IntegrityError, match="(?i)checksum"):
        daemon.prefetch(a).result(10)
    assert daemon.stats.checksum_failures == 1
    from prefetchd.telemetry.metrics import render
    assert "prefetchd_checksum_failures_total" in render(daemon)
    _assert_other_still_fine(daemon, b)


def test_failed_writeback_keeps_the_dirty_replica_in_place(daemon, make_param):
    p = make_param(np.full(MiB // 4, 7, np.float32), "victim.w")
    h = daemon.register(p, tier="device")           # only copy
    _native.inject_fault("write", "error", nth=1, err=28, key_contains="victim")
    with pytest.raises(StorageError, match="ENOSPC"):
        daemon.evict(h).result(10)
    assert h.state is State.RESIDENT and h._rec.dirty and h.tiers == ["device"]
    assert daemon.stats.io_errors["write"] == 1
    with daemon.use(h):
        assert p.asnumpy()[0] == 7                  # nothing lost
    daemon.flush(h).result(10)                      # retried on request, now it lands
    daemon.evict(h).result(10)
    with daemon.use(h):
        assert p.asnumpy()[0] == 7


def test_a_load_with_no_room_retries_the_failed_write_backs_once_the_disk_has_room(ms, make_daemon, make_param):
    """A dirty tensor whose write-back failed (ENOSPC) holds its device memory. Loads that
    needed the room failed until someone called flush(), however long ago the disk had
    room again (an outside probe). They retry the failed write-backs themselves (at most
    every RETRY_FAILED_WRITEBACKS seconds); on a disk still full the load fails, saying why."""
    from prefetchd.core.loads import RETRY_FAILED_WRITEBACKS
    from prefetchd.errors import BudgetError
    daemon = make_daemon(device_budget="1536KiB")              # room for one of the two
    a, b = _two(daemon, make_param, n=MiB // 4)
    with daemon.use(a):
        a.target.set_data(ms.Tensor(np.full(MiB // 4, 9, np.float32)))     # dirty
    _native.inject_fault("write", "error", nth=1, count=1000, err=28, key_contains="victim")
    with pytest.raises(BudgetError, match=r"held because their write-back failed \('victim\.a'; .*ENOSPC"):
        daemon.prefetch(b).result(10)
    _native.clear_faults()                                    # the disk has room again
    time.sleep(RETRY_FAILED_WRITEBACKS)
    daemon.prefetch(b).result(10)                             # no flush(): the load retried it
    with daemon.use(b):
        assert b.target.asnumpy()[0] == 2
    with daemon.use(a):                                       # read back from the store
        assert a.target.asnumpy()[0] == 9 and a.target.asnumpy()[-1] == 9


def test_delayed_read_completes_and_is_timed(daemon, make_param):
    a, b = _two(daemon, make_param)
    _native.inject_fault("read", "delay", nth=1, delay_ms=300, key_contains="victim")
    start = time.monotonic()
    daemon.prefetch(a).result(10)
    assert time.monotonic() - start >= 0.3
    assert daemon.stats.transfer_duration["load"].sum >= 0.3


def test_close_retries_a_failed_writeback_so_nothing_is_lost(store_dir, make_param):
    from prefetchd import Daemon
    d = Daemon(store_dir=store_dir, device_budget="16MiB").start()
    h = d.register(make_param(np.full(MiB // 4, 5, np.float32), "victim.x"), tier="device")
    _native.inject_fault("write", "error", nth=1, err=5, key_contains="victim")
    with pytest.raises(StorageError, match="EIO"):
        d.flush(h).result(10)
    assert h._rec.writeback_failed and h._rec.dirty
    _native.clear_faults()
    d.close(timeout=10)                               # the last chance: it writes it back
    store = _native.FileStore(store_dir)
    try:
        dst = _native.aligned_buffer(MiB)
        store.read_sync("victim.x", dst, True)
        assert np.frombuffer(dst, np.float32, MiB // 4)[-1] == 5
    finally:
        store.close()


def test_a_failed_compute_fence_loses_no_block_and_the_tensor_loads_again(daemon, make_param, monkeypatch):
    """The framework's fence can raise (MindSpore does, from a broken op queue).

    The blocks waiting on that fence still hold their tensors' pages at the
    homes: they must stay waiting, so the tensor's next load takes its block
    back instead of attaching a second one, and the arena gets them back at
    the next fence that works.
    """
    p = make_param(np.full(MiB // 4, 3, np.float32), "victim.f")
    h = daemon.register(p, tier="remote")
    with daemon.use(h):                               # the framework has read the home: exposed
        assert p.asnumpy()[0] == 3
    calls = []
    real = daemon.backend.compute_fence

    def broken_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: the framework's op queue is broken")
        real()
    monkeypatch.setattr(daemon.backend, "compute_fence", broken_once)
    with pytest.raises(Exception, match="injected"):
        daemon.evict(h).result(10)
    assert calls, "the evict did not fence: the test no longer reaches the failure"
    daemon.prefetch(h).result(10)                     # was: attach refused, the home already had a block
    with daemon.use(h):
        assert p.asnumpy()[0] == 3 and p.asnumpy()[-1] == 3
    daemon.evict(h).result(10)                        # a working fence frees everything
    assert daemon.status()["device"]["used"] == 0


def test_a_write_back_retried_by_an_evict_clears_its_failure(daemon, make_param):
    """Only flush() cleared the failed flag: after an evict's retry had landed, the next flush()
    failed with FlushError naming no error, and the tensor was never a watermark victim again
    (a lowering failed 'write-backs failed, so kept: ...' of a write-back that had landed)."""
    p = make_param(np.full(MiB // 4, 7, np.float32), "victim.w")
    h = daemon.register(p, tier="device")
    _native.inject_fault("write", "error", nth=1, err=28, key_contains="victim")
    with pytest.raises(StorageError, match="ENOSPC"):
        daemon.evict(h).result(10)
    daemon.evict(h).result(10)                      # the fault has passed: the retry lands
    assert h.state is State.ABSENT
    with daemon.use(h):
        assert p.asnumpy()[0] == 7
    assert not h._rec.writeback_failed
    daemon.flush().result(10)                       # nothing failed: resolves
    daemon.set_watermarks(4096, 4096).result(10)    # and it is a victim like any other
    assert h.state is State.ABSENT
