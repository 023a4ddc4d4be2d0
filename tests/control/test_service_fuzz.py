"""Fuzzing the control plane: random and mutated frames against a live server
on a real Daemon. Every message the server can route gets exactly one
well-formed reply, the server never stops, and afterwards every well-formed
request is still answered correctly.
"""
import json
import os
import random
import secrets
import socket
import time

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefetchd.control import protocol as P
from prefetchd.control import Client

N_TENSORS = 6
MAX_BODY = 4096                      # small limit, so TOO_LARGE is cheap to reach


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    import mindspore as ms
    import numpy as np

    import prefetchd

    store = tmp_path_factory.mktemp("fuzz-store")
    d = prefetchd.Daemon(device_budget=1 << 20, store_dir=str(store), name="fuzz").start()
    for i in range(N_TENSORS):
        d.register(ms.Tensor(np.full((32, 256), i, np.float32)), name=f"t.{i}", tier="remote")
    server = d.serve(f"ipc://fuzz-{os.getpid()}-{secrets.token_hex(3)}.sock",
                     max_message_size=MAX_BODY, default_lease=0.5, max_lease=2.0)
    ctx = zmq.Context()
    yield d, server, ctx
    ctx.destroy(linger=0)
    d.close(5)


def _dealer(ctx, endpoint):
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(endpoint)
    return sock


def _recv_reply(sock, timeout_ms=5000):
    if not sock.poll(timeout_ms):
        return None
    frames = sock.recv_multipart()
    if frames and frames[0] == b"":          # the echoed REQ-style delimiter
        frames = frames[1:]
    return frames


def _check_reply(frames):
    assert frames is not None, "no reply"
    rid, doc = P.decode_reply(frames)        # raises on a malformed reply
    if not doc["ok"]:
        assert doc["code"] in P.CODES, doc
        assert isinstance(doc["reason"], str) and doc["reason"]
    return rid, doc


OPS = ["ping", "status", "stats", "list", "prefetch", "evict", "flush", "pin", "renew", "unpin",
       "set_watermarks", "nope", "", "PING"]
VALUES = [None, True, False, 0, -1, 1, 2 ** 70, 0.5, -0.0, 1e308, "", "t.1", "t.*", "*", "[",
          "x" * 300, [], ["t.0"], ["t.0", "t.1"], [1, "t.2"], {}, {"a": 1}, [[["t.3"]]]]
KEYS = ["names", "pattern", "priority", "deadline", "wait", "lease", "seconds", "high", "low",
        "limit", "sync", "junk"]


def _random_body(rng):
    args = {rng.choice(KEYS): rng.choice(VALUES) for _ in range(rng.randrange(4))}
    body = {"op": rng.choice(OPS), "args": args}
    if rng.random() < 0.2:
        body["timeout"] = rng.choice([0.001, 0.05, 1, -1, "x", None, 1e9])
    if rng.random() < 0.1:
        body = rng.choice([[body], "op", 7, None, {"args": args}])
    return json.dumps(body).encode()


def _mutate(rng, frames):
    frames = [bytearray(f) for f in frames]
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        i = rng.randrange(len(frames))
        f = frames[i]
        if kind == 0 and f:                                    # flip bytes
            f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        elif kind == 1 and f:                                  # truncate
            del f[rng.randrange(len(f)):]
        elif kind == 2:                                        # insert junk
            pos = rng.randrange(len(f) + 1)
            f[pos:pos] = os.urandom(rng.randint(1, 8))
        elif kind == 3 and len(frames) > 1:                    # drop a frame
            frames.pop(i)
        elif kind == 4:                                        # duplicate a frame
            frames.insert(i, bytearray(f))
        else:                                                  # a wrong version
            frames[0] = bytearray(rng.choice([b"PFD0", b"PFD2", b"PFD", b"PFD11", b"pfd1"]))
    return [bytes(f) for f in frames]


def _random_message(rng):
    roll = rng.random()
    rid = P.new_rid(rng.randrange(1 << 30))
    if roll < 0.25:                                            # pure noise
        return [os.urandom(rng.randint(0, 24)) for _ in range(rng.randint(1, 5))]
    if roll < 0.55:                                            # mutated valid request
        return _mutate(rng, [P.MAGIC, rid, _random_body(rng)])
    if roll < 0.65:                                            # oversize, still below MAXMSGSIZE
        return [P.MAGIC, rid, b'{"op":"ping","args":{"x":"' + b"a" * rng.randint(MAX_BODY, 3 * MAX_BODY)
                + b'"}}']
    if roll < 0.7:                                             # hostile JSON
        return [P.MAGIC, rid, rng.choice([b"[" * 3000 + b"]" * 3000, b'{"op":"ping"' * 300,
                                          b"\xff\xfe\x00", b"NaN", b'{"op":"ping","timeout":NaN}',
                                          b"", b"{}" * 1000])]
    return [P.MAGIC, rid, _random_body(rng)]                  # random but well-framed


def test_seeded_fuzz_every_message_answered(live):
    d, server, ctx = live
    rng = random.Random(0xF022)
    sock = _dealer(ctx, server.endpoint)
    sent = replies = 0
    batch = 40
    started = time.monotonic()
    for _ in range(3000 // batch):
        for _ in range(batch):
            sock.send_multipart(_random_message(rng))
            sent += 1
        # Replies to parked requests (pins, waits) may come later: drain what is there,
        # waiting only while some are missing.
        while replies < sent:
            frames = _recv_reply(sock, 2000)
            if frames is None:
                break
            _check_reply(frames)
            replies += 1
    while replies < sent:
        frames = _recv_reply(sock, 5000)
        if frames is None:
            break
        _check_reply(frames)
        replies += 1
    sock.close(linger=0)
    assert replies == sent, f"{sent - replies} of {sent} messages got no reply"
    assert server.running
    assert server.counters.malformed > 500
    assert time.monotonic() - started < 120


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=6))
def test_hypothesis_frames_get_one_reply(live, frames):
    d, server, ctx = live
    sock = _dealer(ctx, server.endpoint)
    try:
        sock.send_multipart(frames)
        _check_reply(_recv_reply(sock, 5000))
        assert _recv_reply(sock, 20) is None            # exactly one
    finally:
        sock.close(linger=0)


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(op=st.sampled_from(OPS), args=st.dictionaries(st.sampled_from(KEYS), st.sampled_from(VALUES),
                                                     max_size=4))
def test_hypothesis_requests_get_their_own_reply(live, op, args):
    d, server, ctx = live
    sock = _dealer(ctx, server.endpoint)
    try:
        rid = P.new_rid(12345)
        sock.send_multipart(P.encode_request(rid, op, args))
        reply_rid, doc = _check_reply(_recv_reply(sock, 5000))
        assert reply_rid == rid
    finally:
        sock.close(linger=0)


def test_frame_beyond_maxmsgsize_disconnects_only_that_peer(live):
    d, server, ctx = live
    bad = _dealer(ctx, server.endpoint)
    bad.send_multipart([P.MAGIC, P.new_rid(1), b"x" * (5 * MAX_BODY)])
    assert _recv_reply(bad, 500) is None        # cut off by zmq before it is a message
    bad.close(linger=0)
    with Client(server.endpoint, timeout=5) as c:
        assert c.ping()["pong"]


def test_well_formed_requests_still_correct_after_fuzz(live):
    d, server, ctx = live
    # Fuzzed pins hold leases of at most 2 s; wait them out so evict can succeed.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (server.counters.leases_granted
                                           - server.counters.leases_expired
                                           - server.counters.leases_released):
        time.sleep(0.1)
    with Client(server.endpoint, timeout=10) as c:
        c.set_watermarks(0.95, 0.8)
        assert c.ping()["pong"]
        assert c.status()["tensors"] == N_TENSORS
        assert sorted(t["name"] for t in c.list("t.*")) == [f"t.{i}" for i in range(N_TENSORS)]
        c.prefetch(["t.0", "t.1"])
        assert d.tensors("t.0")[0]["state"] == "resident"
        lease = c.pin("t.2", lease=2)
        assert d.tensors("t.2")[0]["pins"] == 1
        assert c.renew(lease)["renewed"] == 1
        c.unpin(lease)
        until = time.monotonic() + 3               # unpin takes effect through the daemon queue
        while d.tensors("t.2")[0]["pins"] and time.monotonic() < until:
            time.sleep(0.02)
        assert d.tensors("t.2")[0]["pins"] == 0
        assert c.evict(["t.0"])["count"] == 1
        assert d.tensors("t.0")[0]["state"] == "absent"
        assert c.flush()["done"] is True
        assert c.stats()["server"]["malformed"] > 0
    assert server.running


@pytest.mark.parametrize("junk", [b"GET / HTTP/1.0\r\n\r\n", b"\x05", bytes(range(1, 200))])
def test_a_peer_that_does_not_speak_zmtp_3_is_dropped_and_its_bytes_never_reach_the_server(live, junk):
    """Bytes whose first is not 0xFF read to libzmq as a ZMTP 1.0 greeting: such a peer was
    through the handshake at once, held its connection for good, and its junk came through
    as messages (an outside probe: 45 s and still connected)."""
    d, server, ctx = live
    path = server.endpoint[len("ipc://"):]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
        peer.connect(path)
        peer.sendall(junk)
        peer.settimeout(5)
        closed = False
        try:
            while peer.recv(4096):
                pass
            closed = True
        except ConnectionResetError:
            closed = True
        except socket.timeout:
            pass
        assert closed, "the server kept the connection of a peer that sent junk"
    with Client(server.endpoint, timeout=5) as c:
        assert c.ping()["pong"]
