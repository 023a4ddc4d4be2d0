"""The compute session's hot path: acquire and release take the daemon's lock a constant
number of times per call, however many records the unit has (the hooks call them once per
unit per pass), and a session's requests are refused once close() began."""
import threading
from concurrent.futures import Future

import mindspore as ms
import numpy as np
import pytest

import prefetchd
from prefetchd.core.requests import Kind, Request
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


def _resident(name, n=2):
    daemon = prefetchd.Daemon(device_budget="8MiB", name=name).start()
    handles = [daemon.register(ms.Parameter(ms.Tensor(np.full((64,), i, np.float32)), name=f"p{i}"))
               for i in range(n)]
    return daemon, tuple(daemon.record(h) for h in handles), handles


def _submitted(daemon):
    """The kinds of the requests submitted from now on (the scheduler still gets them all)."""
    core, kinds = daemon._core, []
    real = core.submit

    def submit(request):
        kinds.append(request.kind.value)
        return real(request)
    core.submit = submit
    return kinds


def test_a_unit_already_resident_is_pinned_without_a_round_trip_through_the_scheduler():
    daemon, records, handles = _resident("pin-resident")
    try:
        session = daemon.compute_session("m")
        kinds = _submitted(daemon)
        assert session.acquire(records) < 1.0
        assert [r.pins for r in records] == [1, 1] and "pin" not in kinds
        session.release(records)                       # the unpin is queued as before
        assert kinds == ["unpin"]
        daemon.evict(handles[:1]).result(10)
        session.acquire(records)                       # one is not resident: the scheduler loads it
        assert "pin" in kinds and all(r.state.value == "resident" for r in records)
        session.release(records)
        daemon.flush().result(10)
        assert [r.pins for r in records] == [0, 0]
    finally:
        daemon.close()


def test_a_resident_pin_passes_queued_prefetches_and_unpins():
    # The hooks queue the previous unit's unpin and the next units' prefetches just
    # before each pin: none of them can take a resident tensor away from this pin.
    daemon, records, handles = _resident("pin-pass", n=2)
    try:
        session = daemon.compute_session("m")
        core = daemon._core
        queued = [Request(Kind.UNPIN, records[:1]), Request(Kind.PREFETCH, records[1:], Future()),
                  Request(Kind.PIN, records[1:], Future())]
        with daemon._lock:
            records[0].pins += 1                       # the pin the queued unpin undoes
            core.inbox.extend(queued)                  # queued, the scheduler not woken for them
        assert session._pin_resident(records)
        assert [r.pins for r in records] == [2, 1]
        core.backend.notify()
        queued[2].future.result(10)
        session.release(records)
        daemon.unpin(handles[1:])                      # the queued pin's
        daemon.flush().result(10)
        assert [r.pins for r in records] == [0, 0]
    finally:
        daemon.close()


def test_a_resident_pin_waits_its_turn_behind_requests_queued_before_it():
    # An evict queued before the pin must apply first, as it would through the inbox.
    daemon, records, handles = _resident("pin-order", n=1)
    try:
        session = daemon.compute_session("m")
        core = daemon._core
        evict = Request(Kind.EVICT, records, Future())
        core.inbox.append(evict)                       # queued, the scheduler not woken for it
        assert not session._pin_resident(records)      # so the pin may not overtake it
        core.backend.notify()
        evict.future.result(10)
        kinds = _submitted(daemon)
        session.acquire(records)                       # reloaded through the scheduler
        assert kinds == ["pin"] and records[0].pins == 1 and records[0].state.value == "resident"
        session.release(records)
    finally:
        daemon.close()
