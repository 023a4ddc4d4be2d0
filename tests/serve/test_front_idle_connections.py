"""The front holds at most `max_connections` client connections (no budget per peer
below that: one gateway may hold a client per thread). One process holding them
all, idle, must not lock every other client out: at the cap, the connection longest
without a request gives way to the new one once it has been idle IDLE_EVICT_AFTER
seconds -- but never one whose request is still unanswered. A real front (in this
process), real worker, and the connections held by another real process."""
import os
import secrets
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import ENV, ping_within
from _servables import sleepy_front
from prefetchd.control.connections import IDLE_EVICT_AFTER

CAP = 6
SLOW = 30.0                   # seconds each held connection's request asks the worker to sleep
REQUEST_TIMEOUT = 9.0         # the front answers them TIMEOUT then: their connections become idle

HOLDER = textwrap.dedent("""
    import sys, time, numpy as np
    from prefetchd.serve import Client
    endpoint, n, sleep = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    clients = [Client(endpoint, timeout=120) for _ in range(n)]
    first = time.monotonic()                   # before the oldest last request was sent
    for c in clients:                          # each connection through the front's guard
        c.infer("m0", np.zeros((1, 4), np.float32))
    x = np.zeros((1, 4), np.float32)
    x[0, 0] = sleep
    futures = [c.submit("m0", x) for c in clients] if sleep else []
    print("held", first, flush=True)
    sys.stdin.readline()
    print("codes", [type(f.exception(120)).__name__ for f in futures], flush=True)
""")


@pytest.fixture
def front(tmp_path):
    f = sleepy_front(tmp_path / "store", f"ipc://{tmp_path}/held-{secrets.token_hex(2)}.sock",
                     f"held{os.getpid()}", request_timeout=REQUEST_TIMEOUT, max_connections=CAP)
    yield f
    f.close(10)


def _hold(front, sleep):
    """The holder process and the monotonic time (one clock for every process here) before
    it sent the first of its connections' requests: none of them is idle before then."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, front.endpoint, str(CAP), str(sleep)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    word, _, first = holder.stdout.readline().strip().partition(" ")
    assert word == "held", holder.poll()
    assert front.connections.counts()["connections"] == CAP
    return holder, float(first)


def _release(holder):
    holder.stdin.write("go\n")
    holder.stdin.flush()
    line = holder.stdout.readline().strip()
    holder.wait(30)
    return line


def test_idle_connections_give_way_to_a_new_client_at_the_cap(front):
    holder, first_request = _hold(front, sleep=0)
    try:
        assert ping_within(front.endpoint, IDLE_EVICT_AFTER + 10), "a new client was locked out by idle connections"
        # It waited for one to be idle: none was before IDLE_EVICT_AFTER after its last
        # request. (Timed from the requests, not from "held": on a loaded machine the
        # holder's six took longer than IDLE_EVICT_AFTER, CI saw. And no request of the new
        # client's is answered on a connection the guard drops: its first one, seen before
        # the connection's admission, was answered early there.)
        assert time.monotonic() >= first_request + IDLE_EVICT_AFTER
        counts = front.connections.counts()
        assert counts["connections_evicted_idle"] >= 1 and counts["connections"] <= CAP, counts
    finally:
        _release(holder)


def test_a_connection_with_a_request_unanswered_is_never_evicted(front):
    holder, _ = _hold(front, sleep=SLOW)     # CAP requests: one runs, the others queue
    try:
        time.sleep(IDLE_EVICT_AFTER + 0.5)    # idle long enough, were they not waiting for replies
        assert not ping_within(front.endpoint, REQUEST_TIMEOUT - IDLE_EVICT_AFTER - 1.5)
        assert front.connections.counts()["connections_evicted_idle"] == 0
        # Answered TIMEOUT at REQUEST_TIMEOUT, they are idle from then on and give way.
        assert ping_within(front.endpoint, IDLE_EVICT_AFTER + 10)
        assert front.connections.counts()["connections_evicted_idle"] >= 1
    finally:
        codes = _release(holder)
    assert codes == f"codes {['RequestTimeout'] * CAP}", codes        # every one answered, none lost
