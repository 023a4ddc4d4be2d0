"""`prefetchd serve`'s workers (issue #30): a killed worker's store under `--store` is removed when
it is respawned and none is left after a clean shutdown (a store per respawn filled the disk);
a stopped (hung) worker is found by the heartbeat, replaced, and requests go to the others
meanwhile; an `infer` argument the front does not know (`delay`) is refused, not ignored.

One front with two real worker processes (spawned, each its own daemon and store); the tests
run in file order and the last one shuts the front down.
"""
import contextlib
import logging
import os
import secrets
import signal
import time

import numpy as np
import pytest
import zmq

from helpers import wait_until
from prefetchd.control import protocol as P
from prefetchd.serve import Client as ServeClient
from prefetchd.serve import Front, ServeSpec
from prefetchd.serve.wire import encode_arrays

SPEC = dict(models=1, hidden=32, layers=2, batch=2, seq=4, lookahead=1)
HEARTBEAT_TIMEOUT = 5.0        # short for the test, long enough that a busy healthy worker answers


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("serve-workers"))
    spec = ServeSpec(store_dir=root, **SPEC)
    front = Front(f"ipc://serve-workers-{os.getpid()}-{secrets.token_hex(2)}.sock", workers=2, spec=spec,
                  request_timeout=30.0, name=f"sw{os.getpid()}", heartbeat_interval=0.25,
                  heartbeat_timeout=HEARTBEAT_TIMEOUT).start()
    yield front, root
    front.close(15)


def _x(seed):
    return np.random.default_rng(seed).standard_normal((SPEC["batch"], SPEC["seq"], SPEC["hidden"])) \
        .astype(np.float32)


def _workers(front):
    return {w["index"]: w for w in front.snapshot()["workers"]}


def _stores(root):
    return sorted(d for d in os.listdir(root) if d.startswith("worker-"))


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _respawned(front, index, old_pid):
    w = _workers(front)[index]
    return w["ready"] and w["pid"] not in (None, old_pid)


def test_a_killed_workers_store_is_removed_when_it_is_respawned(served):
    front, root = served
    before = _workers(front)
    assert _stores(root) == [f"worker-{k}-{before[k]['generation']}" for k in (0, 1)]
    victim = before[0]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: _respawned(front, 0, victim["pid"]), 120)
    after = _workers(front)
    assert after[0]["generation"] == victim["generation"] + 1 and after[0]["deaths"] == victim["deaths"] + 1
    wait_until(lambda: f"worker-0-{victim['generation']}" not in _stores(root), 10)
    assert _stores(root) == [f"worker-0-{after[0]['generation']}", f"worker-1-{after[1]['generation']}"]
    with ServeClient(front.endpoint, timeout=30) as c:
        (y,) = c.infer("m0", _x(1))
    assert y.shape[:2] == (SPEC["batch"], SPEC["seq"]) and np.isfinite(y).all()


def test_a_stopped_worker_is_found_by_its_heartbeat_and_routed_around(served, caplog):
    front, root = served
    caplog.set_level(logging.INFO, logger="prefetchd.serve")
    before = _workers(front)
    hung = before[1]
    hung_before = front.snapshot()["counters"].get("workers_hung", 0)
    os.kill(hung["pid"], signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        answers = []
        with ServeClient(front.endpoint, timeout=30) as c:
            # Requests sent while it is stopped: each is answered (by worker 0, or refused
            # naming the hung worker once it is found), none waits for the 30 s request timeout.
            for i in range(6):
                started = time.monotonic()
                try:
                    c.infer("m0", _x(10 + i))
                    answers.append("ok")
                except Exception as e:               # the ServiceError of a request it held
                    assert "hung: no heartbeat" in str(e), e
                    answers.append("hung")
                assert time.monotonic() - started < HEARTBEAT_TIMEOUT + 10
            wait_until(lambda: front.snapshot()["counters"].get("workers_hung", 0) >= hung_before + 1,
                       HEARTBEAT_TIMEOUT + 15)
            found_after = time.monotonic() - stopped_at
            assert found_after < HEARTBEAT_TIMEOUT + 15
            assert "ok" in answers, answers
            # the stopped process was killed (a SIGKILL reaches a stopped process) and replaced
            wait_until(lambda: not _alive(hung["pid"]), 10)
            wait_until(lambda: _respawned(front, 1, hung["pid"]), 120)
            for i in range(4):
                (y,) = c.infer("m0", _x(20 + i))
                assert np.isfinite(y).all()
    finally:
        try:
            os.kill(hung["pid"], signal.SIGCONT)
        except ProcessLookupError:
            pass
    after = _workers(front)
    assert after[1]["generation"] == hung["generation"] + 1
    # Its death is logged as the kill of a hung worker, whose batches failed when it was
    # replaced (it said "died (signal 9); 0 batches failed"), not as a start that failed.
    deaths = [m for m in (r.getMessage() for r in caplog.records) if f"pid {hung['pid']})" in m]
    assert any("killed as hung, ended (signal 9)" in m for m in deaths), deaths
    assert not any("died" in m or "could not start" in m for m in deaths), deaths
    wait_until(lambda: f"worker-1-{hung['generation']}" not in _stores(root), 10)


def _raw_infer(endpoint, args, arrays):
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    try:
        headers, buffers = encode_arrays(arrays)
        rid = P.new_rid(1)
        sock.send_multipart(P.encode_request(rid, "infer", dict(args, inputs=headers), 20.0, buffers), copy=False)
        assert sock.poll(30_000), "no reply"
        reply_rid, doc, _ = P.decode_reply(sock.recv_multipart(), tensors=True)
        assert reply_rid == rid
        return doc
    finally:
        sock.close()


def test_an_unknown_infer_argument_like_delay_is_refused(served):
    front, _ = served
    doc = _raw_infer(front.endpoint, {"model": "m0", "delay": 30.0}, [_x(3)])
    assert not doc["ok"] and doc["code"] == P.BAD_REQUEST, doc
    assert "unknown argument 'delay'" in doc["reason"] and "infer takes model, inputs, hint" in doc["reason"]
    doc = _raw_infer(front.endpoint, {"model": "m0", "x" * 10_000: 1}, [_x(3)])
    assert doc["code"] == P.BAD_REQUEST and len(doc["reason"]) < 300, doc
    ok = _raw_infer(front.endpoint, {"model": "m0"}, [_x(3)])
    assert ok["ok"], ok


def test_no_worker_store_is_left_after_a_clean_shutdown(served):
    front, root = served
    pids = [w["pid"] for w in _workers(front).values()]
    assert len(_stores(root)) == 2
    front.close(15)
    assert not any(_alive(p) for p in pids)
    assert _stores(root) == []


def test_a_stopped_worker_does_not_hold_up_the_shutdown(tmp_path):
    """A worker stopped (SIGSTOP) when its front closes handled neither the STOP nor the
    SIGTERM, so the close waited out its whole deadline (15-17 s for an outside probe) and
    then killed it. The SIGTERM now comes with a SIGCONT: it exits after the STOP's grace."""
    spec = ServeSpec(store_dir=str(tmp_path), **dict(SPEC, models=1))
    front = Front(f"ipc://serve-stopped-{os.getpid()}-{secrets.token_hex(2)}.sock", workers=1, spec=spec,
                  request_timeout=30.0, name=f"ss{os.getpid()}").start()
    pid = _workers(front)[0]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        front.close(12)
        took = time.monotonic() - started
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert not _alive(pid)
    assert took < 8, took                    # the 3 s grace, then its own close


def test_a_worker_whose_store_keeps_failing_is_picked_last():
    """A worker whose store reads fail (its store directory removed by a cleanup script, an
    outside probe) answers STORAGE at once, so it had the fewest requests in flight and was
    picked for every request while a healthy worker idled; its status said served, failed 0.
    After STORAGE_STREAK batches in a row that all failed STORAGE it is picked only when the
    others are full, it counts them failed, and one success puts it back. (The routing, no
    processes: WorkerPool.pick and WorkerSlot.count_reply.)"""
    from prefetchd.serve.pool import STORAGE_STREAK, WorkerPool
    from prefetchd.serve.spec import ServeSpec
    pool = WorkerPool(2, lambda i: f"ipc://w{i}", "ipc://work", ServeSpec(), max_inflight=2)
    broken, healthy = pool.slots
    for slot in pool.slots:
        slot.ready, slot.last_model = True, "m0"
    for n in range(STORAGE_STREAK):
        assert pool.pick("m0") is broken                  # a tie goes to the first, as before
        broken.count_reply(2, ["STORAGE", "STORAGE"])
    assert (broken.failed, broken.served, broken.storage_streak) == (STORAGE_STREAK, 0, STORAGE_STREAK)
    assert pool.pick("m0") is healthy
    healthy.inflight = {b"a": None, b"b": None}           # full: the failing one still serves
    assert pool.pick("m0") is broken
    healthy.inflight = {}
    broken.count_reply(2, ["STORAGE"])                      # one of two answered: it works again
    assert broken.storage_streak == 0 and pool.pick("m0") is broken
    broken.count_reply(1, ["INTERNAL"])                     # another failure: no streak
    assert broken.storage_streak == 0 and broken.failed == STORAGE_STREAK + 1
