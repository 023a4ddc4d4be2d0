"""The compute session's hot path: acquire and release take the daemon's lock a constant
number of times per call, however many records the unit has (the hooks call them once per
unit per pass), and a session's requests are refused once close() began."""
import threading

import mindspore as ms
import numpy as np
import pytest

import prefetchd
from prefetchd.errors import ShutdownError


class CountingLock:
    """A Lock that counts acquisitions made by one thread (the caller's, not the scheduler's)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.thread = None
        self.count = 0

    def __enter__(self):
        self._lock.acquire()
        if threading.get_ident() == self.thread:
            self.count += 1
        return self

    def __exit__(self, *exc):
        self._lock.release()

    def acquire(self, *args, **kwargs):
        got = self._lock.acquire(*args, **kwargs)
        if got and threading.get_ident() == self.thread:
            self.count += 1
        return got

    def release(self):
        self._lock.release()


def _rounds(n_records):
    daemon = prefetchd.Daemon(device_budget="8MiB", name=f"rounds{n_records}")
    lock = daemon._lock = CountingLock()    # before start(): the core and binding share it
    with daemon:
        handles = [daemon.register(ms.Parameter(ms.Tensor(np.full((64,), i, np.float32)), name=f"p{i}"))
                   for i in range(n_records)]
        records = tuple(daemon.record(h) for h in handles)
        session = daemon.compute_session("m")
        session.acquire(records)          # warm: every record resident
        session.release(records)
        lock.thread, lock.count = threading.get_ident(), 0
        session.acquire(records)
        session.release(records)
        return lock.count


def test_acquire_and_release_take_the_lock_a_constant_number_of_times():
    one, many = _rounds(1), _rounds(40)
    assert many == one, f"{one} lock rounds for 1 record, {many} for 40"


def test_a_session_is_refused_once_its_daemon_closed():
    daemon = prefetchd.Daemon(device_budget="1MiB", name="rounds-closed").start()
    h = daemon.register(ms.Parameter(ms.Tensor(np.ones(4, np.float32)), name="w"))
    session = daemon.compute_session("m")
    daemon.close()
    with pytest.raises(ShutdownError, match="is closed"):
        session.acquire((daemon.record(h),))
