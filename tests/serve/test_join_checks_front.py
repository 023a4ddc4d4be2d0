"""A real front and two real worker processes serving `sleepy` (a request sleeps as long as its
first value asks, then runs a Dense layer; joined, one sleep serves the batch). Until a
worker has checked that a model's joined outputs split per request it runs a batch's
requests one after another (prefetchd.serve.execute), so the batches sent to it while it
checks must stay small: a burst of slow requests sent as one full batch to one worker timed
out at its tail while the other worker idled."""
import os
import secrets

import numpy as np
import pytest

from prefetchd.serve import Client, Front, ServeSpec

SLEEP = 1.0                   # seconds each request asks for
BURST = 8                     # one full batch of max_batch_size
TIMEOUT = 6.5                 # a batch of BURST run one by one takes BURST * SLEEP: 8 s


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    spec = ServeSpec(models=1, model="tests.serve._servables:sleepy", model_bytes_hint=80, budget=1 << 20,
                     store_dir=str(tmp_path_factory.mktemp("join-store")))
    f = Front(f"ipc://join-{os.getpid()}-{secrets.token_hex(2)}.sock", workers=2, spec=spec,
              name=f"join{os.getpid()}", max_batch_size=BURST, max_queue_delay_ms=50,
              request_timeout=TIMEOUT).start()
    yield f
    f.close(10)


def _distinct(rng, sleep):
    x = rng.standard_normal((1, 4)).astype(np.float32)
    x[0, 0] = sleep
    return x


def test_a_burst_of_slow_requests_is_spread_in_small_batches_while_the_workers_check(front):
    rng = np.random.default_rng(7)
    with Client(front.endpoint, timeout=60) as c:
        xs = [_distinct(rng, SLEEP) for _ in range(BURST)]
        futures = [c.submit("m0", x) for x in xs]
        for f in futures:
            f.result(60)            # raises on TIMEOUT
        assert {f.reply["worker"] for f in futures} == {0, 1}
        assert all(f.reply["batch_size"] == 1 for f in futures)     # each ran alone (unchecked)


def test_once_a_worker_has_checked_the_model_its_batches_run_joined(front):
    rng = np.random.default_rng(8)
    with Client(front.endpoint, timeout=60) as c:
        for _ in range(12):         # three checks per worker, each after a batch of two
            futures = [c.submit("m0", _distinct(rng, 0.0)) for _ in range(BURST)]
            for f in futures:
                f.result(60)
            if max(f.reply["batch_size"] for f in futures) > 2:
                return
    pytest.fail(f"no batch of more than two ran joined: {[f.reply['batch_size'] for f in futures]}")


def test_a_check_is_put_off_while_the_next_batch_would_miss_its_deadline(tmp_path):
    """The check's joined call ran right after each reply, ahead of the next batch already
    sent to that worker: ten 1 s requests on two workers under --request-timeout 7.5 timed
    out their last ones (an outside probe, at 6.5). Now a worker puts a check off while a
    batch it has received would miss a deadline, and runs it once idle."""
    spec = ServeSpec(models=1, model="tests.serve._servables:sleepy", model_bytes_hint=80, budget=1 << 20,
                     store_dir=str(tmp_path / "store"))
    f = Front(f"ipc://{tmp_path}/f.sock", workers=2, spec=spec, name=f"joinlate{os.getpid()}",
              max_batch_size=BURST, max_queue_delay_ms=50, request_timeout=7.5).start()
    try:
        rng = np.random.default_rng(9)
        with Client(f.endpoint, timeout=60) as c:
            futures = [c.submit("m0", _distinct(rng, SLEEP)) for _ in range(10)]
            for fut in futures:
                fut.result(60)      # raises on TIMEOUT
    finally:
        f.close(10)


def test_checks_fit_counts_the_next_batch_and_the_check_against_its_earliest_deadline():
    from prefetchd.serve.execute import checks_fit
    parts = [{"deadline": 10.0}, {"deadline": 7.0}, {"inputs": []}]
    assert checks_fit(parts, 1.0, now=2.0)          # 2 + (2 + 3) * 1 = 7
    assert not checks_fit(parts, 1.0, now=2.5)
    assert checks_fit([{"inputs": []}], 100.0, now=0.0) and checks_fit([], 100.0, now=0.0)
