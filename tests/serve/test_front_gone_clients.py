"""Requests queued by a client that has gone are not run: once a reply to it is found
unroutable (its connection is closed), the front drops the rest of its queue, so the
clients still there do not wait behind work nobody will take. A real front (in this
process), a real worker, and the vanishing client in another real process."""
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
