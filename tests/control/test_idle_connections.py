"""The daemon's control server holds at most `max_connections` connections. One process
holding them all, idle, must not lock every other client out: at the cap, the ROUTER
connection longest without a request gives way to the new one once it has been idle
IDLE_EVICT_AFTER seconds -- never one whose request is unanswered, and never an events
subscriber (it sends no requests, so it is always "idle"). A real daemon and server in
this process; the connections held by another real process (tests/control/_idle_holder.py)."""
import os
import secrets
import subprocess
import sys
import time

import pytest

from helpers import ENV, ping_within
from prefetchd.control.connections import IDLE_EVICT_AFTER

HOLDER = os.path.join(os.path.dirname(__file__), "_idle_holder.py")
DEALERS = os.path.join(os.path.dirname(__file__), "_idle_dealers.py")
CLIENTS = 3                       # the holder's clients; its subscription makes the cap
CAP = CLIENTS + 1
SLOW_MS = 8000                    # how long the slow requests' read takes


@pytest.fixture
def served(make_daemon, tmp_path):
    import mindspore as ms
    import numpy as np

    daemon = make_daemon(device_budget=1 << 20)
    for i in range(8):
        daemon.register(ms.Tensor(np.full((64, 256), i, np.float32)), name=f"layer.{i}.weight",
                        tier="remote")
    server = daemon.serve(f"ipc://{tmp_path}/idle-{secrets.token_hex(2)}.sock", max_connections=CAP)
    yield daemon, server
    server.close(5)


def _hold(server, slow):
    holder = subprocess.Popen([sys.executable, HOLDER, server.endpoint, str(CLIENTS), "1" if slow else "0"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    word, _, first = holder.stdout.readline().strip().partition(" ")
    assert word == "held", holder.poll()
    assert server.server_status()["connections"] == CAP
    return holder, float(first)


def _release(holder):
    holder.stdin.write("go\n")
    holder.stdin.flush()
    out = dict(line.strip().partition(" ")[::2] for line in holder.stdout)
    assert holder.wait(30) == 0
    return out


def test_an_idle_client_gives_way_at_the_cap_and_the_subscriber_stays(served):
    daemon, server = served
    holder, first = _hold(server, slow=False)
    try:
        assert ping_within(server.endpoint, IDLE_EVICT_AFTER + 10), "a new client was locked out by idle clients"
        assert time.monotonic() >= first + IDLE_EVICT_AFTER
        counts = server.server_status()
        assert counts["connections_evicted_idle"] >= 1 and counts["connections"] <= CAP, counts
    finally:
        out = _release(holder)
    assert out["sub"] == "0", out                  # the oldest connection, yet never taken for idle
    assert int(out["clients"]) >= 1, out


def test_a_client_with_a_request_unanswered_is_never_evicted(served, native_faults):
    daemon, server = served
    native_faults.inject_fault("read", "delay", delay_ms=SLOW_MS, key_contains="layer.7")
    started = time.monotonic()
    holder, _ = _hold(server, slow=True)
    try:
        time.sleep(IDLE_EVICT_AFTER + 0.5)       # idle long enough, were they not waiting for replies
        assert time.monotonic() - started < SLOW_MS / 1000 - 1, "too slow to test before the reads end"
        assert not ping_within(server.endpoint, 1.0)
        assert server.server_status()["connections_evicted_idle"] == 0
        # Answered once the read is done, the clients are idle from then on and give way.
        assert ping_within(server.endpoint, SLOW_MS / 1000 + IDLE_EVICT_AFTER + 10)
        assert server.server_status()["connections_evicted_idle"] >= 1
    finally:
        out = _release(holder)
    assert out["codes"] == str(["ok"] * CLIENTS), out     # every one answered, none lost
    assert out["sub"] == "0", out


def test_idle_connections_beyond_the_cap_that_reconnect_do_not_lock_a_client_out(served):
    # libzmq connects a shut-down connection again by itself, at once: one process holding
    # more idle connections than the cap kept every slot younger than IDLE_EVICT_AFTER by
    # its own reconnects, and every new client was dropped with its request (an outside
    # probe: 700 idle DEALERs against `prefetchd serve`'s 512 locked out 6 of 6 clients).
    daemon, server = served
    holder = subprocess.Popen([sys.executable, DEALERS, server.endpoint, str(4 * CAP)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held", holder.poll()
        time.sleep(IDLE_EVICT_AFTER + 1)          # the slots' holders are idle long enough
        for _ in range(3):
            assert ping_within(server.endpoint, 10), "a new client was locked out by reconnecting idle ones"
        assert server.server_status()["connections_evicted_idle"] >= 1
    finally:
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.wait(30) == 0
