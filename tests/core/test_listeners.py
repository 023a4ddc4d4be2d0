"""Listeners and future callbacks run outside the daemon's lock: each may call back into
the daemon (status, tensors, flush, close) and nothing deadlocks. Every wait is bounded."""
import threading

import numpy as np
import pytest

MiB = 1 << 20


def _remote(daemon, make_param, n=3):
    return [daemon.register(make_param(np.full(MiB // 4, i, np.float32), f"t{i}"), tier="remote")
            for i in range(n)]


def test_a_listener_may_call_status_tensors_and_flush(daemon, make_param):
    handles = _remote(daemon, make_param)
    seen = []

    def listener(event):
        status = daemon.status()
        listed = daemon.tensors("t*")
        daemon.flush()           # a future; not waited on (the scheduler thread settles it)
        seen.append((event["event"], status["tensors"], len(listed)))

    daemon.add_listener(listener)
    daemon.prefetch(handles).result(timeout=10)
    # The listener ran before the prefetch resolved, and the scheduler still serves.
    assert [s for s in seen if s[0] == "loaded"] == [("loaded", 3, 3)] * 3, seen
    daemon.evict(handles[0]).result(timeout=10)
    daemon.flush().result(timeout=10)
    assert daemon.status()["states"]["resident"] == 2


def test_a_listener_may_close_the_daemon(make_daemon, make_param):
    daemon = make_daemon()
    handles = _remote(daemon, make_param, 1)
    closed_from = []

    def listener(event):
        daemon.close()
        closed_from.append(threading.current_thread().name)

    daemon.add_listener(listener)
    daemon.prefetch(handles).result(timeout=10)
    assert closed_from and closed_from[0].startswith("prefetchd-scheduler")
    daemon._thread.join(10)
    assert not daemon._thread.is_alive(), "the scheduler did not stop after a listener's close()"
    daemon.close(5)               # finishes what the listener's close() started
    assert daemon.closed


def test_future_callbacks_may_call_status_flush_and_close(make_daemon, make_param):
    daemon = make_daemon()
    handles = _remote(daemon, make_param, 2)
    done = threading.Event()
    results = {}

    def callback(future):
        results["status"] = daemon.status()["tensors"]
        results["flush"] = daemon.flush()
        daemon.close()
        done.set()

    daemon.prefetch(handles).add_done_callback(callback)
    assert done.wait(10), "a future callback calling the daemon deadlocked"
    assert results["status"] == 2
    results["flush"].result(timeout=10)     # settled (by the shutdown at the latest)
    daemon._thread.join(10)
    assert not daemon._thread.is_alive()
    daemon.close(5)
    assert daemon.closed


def test_a_raising_listener_is_skipped(daemon, make_param):
    handles = _remote(daemon, make_param, 2)
    daemon.add_listener(lambda e: 1 / 0)
    got = []
    daemon.add_listener(got.append)
    daemon.prefetch(handles).result(timeout=10)
    assert sorted(e["name"] for e in got if e["event"] == "loaded") == ["t0", "t1"]
