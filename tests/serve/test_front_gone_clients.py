"""Requests queued by a client that has gone are not run: once a reply to it is found
unroutable (its connection is closed), the front drops the rest of its queue, so the
clients still there do not wait behind work nobody will take; nor does a worker run a
request whose deadline passed before it reached it. A real front (in this process), a
real worker, and the vanishing client in another real process."""
import os
import secrets
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import ENV
from _servables import sleepy_front
from prefetchd.serve import Client

QUEUED, SLEEP = 30, 0.4       # the gone client's backlog: 12 s of the worker's time

VANISHING = textwrap.dedent("""
    import os, sys, time, numpy as np
    from prefetchd.serve import Client
    c = Client(sys.argv[1], timeout=120)
    c.infer("m0", np.zeros((1, 4), np.float32))
    x = np.zeros((1, 4), np.float32)
    x[0, 0] = float(sys.argv[3])
    futures = [c.submit("m0", x) for _ in range(int(sys.argv[2]))]
    time.sleep(1.0)                 # sent, and queued at the front
    print("gone", flush=True)
    os._exit(0)                     # no close: the connection just drops
""")


@pytest.fixture
def front(tmp_path):
    f = sleepy_front(tmp_path / "store", f"ipc://{tmp_path}/gone-{secrets.token_hex(2)}.sock",
                     f"gone{os.getpid()}")
    yield f
    f.close(10)


def test_the_queue_of_a_client_that_has_gone_is_dropped(front):
    vanishing = subprocess.run([sys.executable, "-c", VANISHING, front.endpoint, str(QUEUED), str(SLEEP)],
                               capture_output=True, text=True, env=ENV, timeout=120)
    assert vanishing.stdout.strip() == "gone", vanishing.stderr[-2000:]
    started = time.monotonic()
    with Client(front.endpoint, timeout=60) as c:
        (y,) = c.infer("m0", np.ones((1, 4), np.float32))
    waited = time.monotonic() - started
    assert y.shape == (1, 4)
    # Behind at most the batches in flight when the first reply found the client gone (2 per
    # worker) and the one that found it, not behind all 30 (12 s).
    assert waited < 6 * SLEEP + 2.0, f"waited {waited:.1f} s behind a gone client's queue"
    assert front.counters["abandoned"] >= QUEUED - 6, dict(front.counters)


def test_requests_that_timed_out_are_not_run_when_the_worker_reaches_them(front):
    """Two slow requests time out at their clients' deadline: one runs on the worker, the
    other waits in the worker's in-flight slot. That one was run all the same when the
    worker reached it, and a request sent after them waited behind both (probe M: under
    overload, dead work made live requests time out too). The worker now skips a part
    whose deadline passed: the later request waits for the running one only."""
    slow = np.zeros((1, 4), np.float32)
    slow[0, 0] = 5.0
    with Client(front.endpoint, timeout=60) as c:
        c.infer("m0", np.zeros((1, 4), np.float32))           # warm: the worker is ready
        started = time.monotonic()
        doomed = [c.submit("m0", slow, timeout=1.0) for _ in range(2)]
        for future in doomed:
            with pytest.raises(Exception, match="TIMEOUT|within"):
                future.result(30)
        (y,) = c.infer("m0", np.ones((1, 4), np.float32))
        waited = time.monotonic() - started
    assert y.shape == (1, 4)
    assert waited < 8.0, f"waited {waited:.1f} s: behind a request that had timed out (5 s each)"
