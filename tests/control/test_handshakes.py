"""The handshake pool (prefetchd/control/handshakes.py) on real loopback TCP connections:
who is pushed out when a new connection arrives at a full pool.

The server side here never answers (like libzmq's I/O thread busy with a flood), so
only what the peers sent tells the silent ones from the ones that spoke."""
import socket
import time

from prefetchd.control.handshakes import (ANSWER_GRACE, ANSWERED, GREETING, GREETING_GRACE, PARTIAL, SILENT,
                                          SPOKE, STALLED, Handshakes, progress, tcp_counts)


def _answer(fd, nbytes=GREETING + 1):
    """The server's side sends `nbytes` on `fd` and waits until the peer acknowledged them."""
    peer = socket.socket(fileno=fd)
    try:
        peer.sendall(b"a" * nbytes)
    finally:
        peer.detach()
    deadline = time.monotonic() + 5
    while tcp_counts(fd)[0] < nbytes and time.monotonic() < deadline:
        time.sleep(0.001)
    assert progress(fd) == ANSWERED


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_the_kernel_counts_what_the_peer_sent(pairs):
    quiet, partial, spoke = pairs(), pairs(b"g" * 10), pairs(b"g" * GREETING)
    assert tcp_counts(quiet) == (0, 0) and progress(quiet) == SILENT
    assert tcp_counts(partial) == (0, 10) and progress(partial) == PARTIAL
    assert tcp_counts(spoke) == (0, GREETING) and progress(spoke) == SPOKE


def test_a_new_connection_pushes_out_a_silent_one_not_an_older_one_that_spoke(pairs):
    pool = Handshakes(2, clock=Clock())
    client = pairs(b"g" * GREETING)            # its greeting is in, not answered yet
    flood = pairs()
    assert pool.add(client, "addr", 999) == []
    assert pool.add(flood, "addr", 999) == []
    newer = pairs()
    assert pool.add(newer, "addr", 999) == [flood]
    assert client in pool and newer in pool and flood not in pool


def test_a_full_pool_of_peers_mid_handshake_refuses_the_new_one_until_one_stalls(pairs):
    clock = Clock()
    pool = Handshakes(2, clock=clock)
    first, second = pairs(b"g"), pairs(b"g")
    _answer(first), _answer(second)                       # both mid-handshake
    pool.add(first, "addr", 999)
    clock.now = 0.5
    pool.add(second, "addr", 999)
    late = pairs()
    assert pool.add(late, "addr", 999) == [late]          # nobody silent, nobody stalled
    clock.now = STALLED                                   # the first has stalled
    assert pool.add(late, "addr", 999) == [first]
    assert list(pool._fds) == [second, late]


def test_a_peer_that_spoke_but_stalls_unanswered_goes_after_a_grace(pairs):
    """A flood sending a few bytes of greeting and stalling kept every slot (it had spoken)
    and locked new clients out; a client in a burst the server has not answered yet
    keeps its slot for ANSWER_GRACE."""
    clock = Clock()
    pool = Handshakes(3, clock=clock)
    partial, unanswered, client = pairs(b"g" * 10), pairs(b"g" * GREETING), pairs(b"g" * GREETING)
    for fd in (partial, unanswered, client):
        pool.add(fd, "addr", 999)
    new = pairs(b"g")
    assert pool.add(new, "addr", 999) == [new]            # all young: the new one goes
    clock.now = GREETING_GRACE
    assert pool.add(new, "addr", 999) == [partial]        # less than a greeting, for too long
    clock.now = ANSWER_GRACE
    _answer(client)                                       # the server got to the client
    newer = pairs(b"g")
    assert pool.add(newer, "addr", 999) == [unanswered]   # spoke, never answered
    assert client in pool and new in pool and newer in pool


def test_through_takes_the_ones_the_server_answered_past_their_threshold(pairs):
    pool = Handshakes(4, clock=Clock())
    waiting = pairs(b"g" * GREETING)
    answered = pairs(b"g" * GREETING)
    pool.add(waiting, "a", GREETING + 1)
    pool.add(answered, "b", GREETING + 1)
    peer = socket.socket(fileno=answered)
    try:
        peer.sendall(b"r" * (GREETING + 1))               # the server's side answers
    finally:
        peer.detach()
    deadline = time.monotonic() + 5
    while tcp_counts(answered)[0] < GREETING + 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert pool.through() == [(answered, "b")]
    assert waiting in pool and answered not in pool

