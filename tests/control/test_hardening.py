"""Control-plane hardening against a real Daemon: numbers too large for the
daemon's arithmetic are BAD_REQUEST (never INTERNAL, never a dead server),
allow_remote needs CURVE keys or an explicit insecure flag, and an explicit ipc
path must be in a private directory."""
import json
import os
import secrets
import time

import pytest
import zmq

from prefetchd.errors import ConfigError
from prefetchd.control import Client, Server, ServiceError, create_keys
from prefetchd.control import protocol as P

HUGE = 10 ** 4000                     # parses as JSON; overflows float()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    import mindspore as ms
    import numpy as np

    import prefetchd

    d = prefetchd.Daemon(device_budget=1 << 20, name="hard",
                         store_dir=str(tmp_path_factory.mktemp("hard-store"))).start()
    d.register(ms.Tensor(np.ones((64, 64), np.float32)), name="w", tier="remote")
    yield d
    d.close(5)


@pytest.fixture(scope="module")
def served(daemon):
    server = Server(daemon, f"ipc://hard-{os.getpid()}-{secrets.token_hex(3)}.sock").start()
    yield server
    server.close(2)


def _raw(endpoint, body):
    """Send a hand-made JSON body (Client cannot encode HUGE); the reply doc or None."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint)
        sock.send_multipart([P.MAGIC, b"rid00001", json.dumps(body).encode()])
        if not sock.poll(5000):
            return None
        return P.decode_reply(sock.recv_multipart())[1]
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("op,args", [
    ("prefetch", {"names": ["w"], "priority": HUGE}),
    ("prefetch", {"names": ["w"], "priority": -HUGE}),
    ("prefetch", {"names": ["w"], "deadline": HUGE}),
    ("pin", {"names": ["w"], "lease": HUGE}),
    ("renew", {"lease": "abc", "seconds": HUGE}),
    ("list", {"limit": HUGE}),
    ("set_watermarks", {"high": HUGE}),
])
def test_huge_integer_arguments_are_bad_requests(served, op, args):
    doc = _raw(served.endpoint, {"op": op, "args": args})
    assert doc is not None, "no reply"
    assert doc["ok"] is False and doc["code"] == P.BAD_REQUEST, doc
    assert served.counters.errors.get(P.INTERNAL, 0) == 0
    with Client(served.endpoint, timeout=5) as c:
        assert c.ping()["pong"]


def test_huge_request_timeout_is_a_bad_request_and_the_server_lives(served):
    doc = _raw(served.endpoint, {"op": "ping", "args": {}, "timeout": HUGE})
    assert doc is not None and doc["code"] == P.BAD_REQUEST and "timeout" in doc["reason"], doc
    with Client(served.endpoint, timeout=5) as c:
        assert c.ping()["pong"]                  # the I/O loop did not die on it


def test_allow_remote_without_curve_is_refused(daemon):
    with pytest.raises(ConfigError, match="allow_insecure_remote"):
        Server(daemon, "tcp://127.0.0.1:0", allow_remote=True)


def test_allow_remote_with_the_insecure_flag_or_curve_keys(daemon, tmp_path):
    for kwargs in ({"allow_insecure_remote": True},
                   {"curve_keys_dir": create_keys(str(tmp_path / "keys"))}):
        server = Server(daemon, "tcp://127.0.0.1:0", allow_remote=True, **kwargs).start()
        try:
            assert server.running and server.endpoint.startswith("tcp://127.0.0.1:")
        finally:
            server.close(2)


def test_ipc_socket_in_a_world_writable_directory_is_refused(daemon):
    path = f"/tmp/prefetchd-hard-{secrets.token_hex(3)}.sock"
    with pytest.raises(ConfigError, match="/tmp") as err:
        Server(daemon, f"ipc://{path}").start()
    assert "writable" in str(err.value) or "belongs to uid" in str(err.value)
    assert not os.path.exists(path)


def test_ipc_socket_in_a_group_writable_directory_of_ours_is_refused(daemon, tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o770)
    with pytest.raises(ConfigError, match=str(loose)):
        Server(daemon, f"ipc://{loose}/ctl.sock").start()
    assert oct(os.stat(loose).st_mode & 0o777) == oct(0o770)      # refused, not "fixed"


def test_a_pattern_over_the_length_limit_is_a_bad_request_at_once(served):
    from prefetchd.core.patterns import MAX_PATTERN
    with Client(served.endpoint, timeout=5) as c:
        for op in ("list", "prefetch", "evict"):
            started = time.monotonic()
            with pytest.raises(ServiceError) as err:
                c.call(op, pattern="[" * 15000)
            assert err.value.code == P.BAD_REQUEST and f"at most {MAX_PATTERN}" in str(err.value)
            assert time.monotonic() - started < 2.0
        assert [t["name"] for t in c.list("[" * MAX_PATTERN)] == []
        assert [t["name"] for t in c.list("[vw]")] == ["w"]
