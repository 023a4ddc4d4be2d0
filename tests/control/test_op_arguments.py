"""A daemon's control operations take only the arguments they declare, each once:
a repeated lease id is one lease, an unknown (misspelled) argument or an unusable
tensor name is BAD_REQUEST naming it, never ignored, never INTERNAL. A real Daemon
and Server, clients on real ZeroMQ sockets and `prefetchd ctl` run as a subprocess."""
import json
import os
import secrets
import subprocess
import sys
import time

import pytest
import zmq

from helpers import wait_until
from prefetchd.control import Client, ServiceError
from prefetchd.control import protocol as P

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NAMES = [f"layer.{i}.weight" for i in range(4)]


@pytest.fixture(scope="module")
def served(tmp_path_factory, mindspore_cpu):
    import numpy as np

    import prefetchd
    d = prefetchd.Daemon(device_budget=1 << 20, store_dir=str(tmp_path_factory.mktemp("store")),
                         name="opargs").start()
    for i, name in enumerate(NAMES):
        d.register(mindspore_cpu.Tensor(np.full((64, 256), i, np.float32)), name=name, tier="remote")
    server = d.serve(f"ipc://t-opargs-{os.getpid()}-{secrets.token_hex(3)}.sock")
    with Client(server.endpoint, timeout=5.0) as client:
        yield d, server, client
    d.close(5)


def ctl(endpoint, *args):
    return subprocess.run([sys.executable, "-m", "prefetchd.cli", "ctl", "--endpoint", endpoint, *args],
                          capture_output=True, text=True, cwd=REPO, timeout=60,
                          env={**os.environ, "PYTHONPATH": REPO})


def raw_frames(endpoint, frames):
    """One request on a plain DEALER, as any peer may send it: the reply document."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(endpoint)
        sock.send_multipart(frames)
        assert sock.poll(5000), f"{frames[2][:60]!r}: no reply"
        return P.loads(sock.recv_multipart()[2])
    finally:
        ctx.destroy(linger=0)


def raw(endpoint, op, args):
    return raw_frames(endpoint, P.encode_request(P.new_rid(1), op, args))


def internal_errors(server):
    return server.counters.errors.get(P.INTERNAL, 0)


# ----------------------------------------------------------------------------- repeated lease ids

def test_unpin_and_renew_with_a_repeated_lease_id_are_one_lease(served):
    daemon, server, client = served
    internal = internal_errors(server)
    lease = client.pin(NAMES[0], lease=30)
    assert client.call("unpin", lease=[lease, lease]) == {"count": 1}     # was INTERNAL, released
    assert wait_until(lambda: daemon.status()["pinned"] == 0)
    assert client.status()["server"]["leases"] == 0
    with pytest.raises(ServiceError) as err:                    # gone now: said, not INTERNAL
        client.call("unpin", lease=[lease, lease])
    assert err.value.code == P.BAD_REQUEST and "expired or released" in str(err.value)

    lease = client.pin(NAMES[1], lease=30)
    assert client.call("renew", lease=[lease, lease], seconds=20) == {"renewed": 1, "expires_in": 20.0}
    out = ctl(server.endpoint, "renew", lease, lease)           # the shell's way
    assert out.returncode == 0 and json.loads(out.stdout)["renewed"] == 1, out.stderr
    out = ctl(server.endpoint, "unpin", lease, lease)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"count": 1}
    assert wait_until(lambda: daemon.status()["pinned"] == 0)
    assert internal_errors(server) == internal


# ----------------------------------------------------------------------------- unknown arguments

@pytest.mark.parametrize("op, args, named, takes", [
    ("list", {"patern": "layer.0.*"}, "'patern'", "list takes pattern, limit"),
    ("pin", {"names": [NAMES[2]], "leese": 3600}, "'leese'", "pin takes names, pattern, lease"),
    ("prefetch", {"names": [NAMES[2]], "delay": 1}, "'delay'", "prefetch takes names, pattern, wait"),
    ("unpin", {"lease": "x", "lease_id": "y"}, "'lease_id'", "unpin takes lease"),
    ("status", {"verbose": True}, "'verbose'", "status takes none"),
])
def test_an_unknown_argument_is_refused_naming_it_and_the_accepted_ones(served, op, args, named, takes):
    daemon, server, client = served
    reply = raw(server.endpoint, op, args)
    assert reply["ok"] is False and reply["code"] == P.BAD_REQUEST, reply
    assert named in reply["reason"] and takes in reply["reason"], reply["reason"]
    assert daemon.status()["pinned"] == 0 and client.status()["server"]["leases"] == 0
    assert daemon.tensors(NAMES[2])[0]["state"] == "absent"      # nothing was done


def raw_body(endpoint, body):
    """One request whose body frame is `body` (bytes): the reply."""
    return raw_frames(endpoint, [P.MAGIC, P.new_rid(2), body])


@pytest.mark.parametrize("body, why", [
    (b'{"op": "ping", "timout": 0.5}', "unknown field 'timout' in the body; it takes args, op, timeout"),
    ('{"op": "ping"}'.encode("utf-16"), "body is not UTF-8"),      # json.loads of bytes took it
    (b'{"op": "ping", "op": "status"}', "the key 'op' is given twice"),   # the last silently won
    (b'{"op": "list", "args": {"limit": 1, "limit": 2}}', "the key 'limit' is given twice"),
])
def test_a_body_with_an_unknown_field_or_not_in_utf8_is_refused_saying_so(served, body, why):
    """A misspelled top-level 'timeout' was ignored (the request ran without its timeout),
    and a UTF-16 body was answered (outside probe V): the body is UTF-8 JSON {op, args, timeout}."""
    _, server, _ = served
    reply = raw_body(server.endpoint, body)
    assert reply["ok"] is False and reply["code"] == P.BAD_REQUEST and why in reply["reason"], reply
    assert raw_body(server.endpoint, b'{"op": "ping", "args": {}, "timeout": 5}')["ok"] is True
    assert raw_body(server.endpoint, b'\xef\xbb\xbf{"op": "ping"}')["ok"] is True     # a UTF-8 BOM is fine


def test_a_body_of_many_keys_one_given_twice_is_refused_at_once(served):
    """The duplicate was found with keys.count() for each key: a 650 KB body (under the 1 MiB
    limit) of 60,000 keys, the last given twice, held the server's I/O thread for 51 s."""
    _, server, _ = served
    n = 60000
    body = ("{" + ",".join(f'"k{i}":0' for i in range(n)) + f',"k{n - 1}":0}}').encode()
    started = time.monotonic()
    reply = raw_body(server.endpoint, body)
    assert time.monotonic() - started < 5, "the duplicate key took the I/O thread for seconds"
    assert reply["ok"] is False and f"the key 'k{n - 1}' is given twice" in reply["reason"], reply


def test_the_client_and_ctl_send_only_arguments_the_ops_take(served):
    daemon, server, client = served
    bad = server.counters.errors.get(P.BAD_REQUEST, 0)
    assert client.ping()["pong"] and client.status() and client.stats()
    assert len(client.list("layer.*", limit=2)) == 2
    client.prefetch(NAMES[3], priority=2, deadline=10.0, wait=True)
    lease = client.pin(pattern="layer.3.*", lease=10)
    client.renew(lease, seconds=20)
    client.unpin(lease)
    client.flush(wait=True)
    client.evict(NAMES[3], wait=True)
    client.set_watermarks(0.9, 0.6)
    with client.subscribe() as sub:
        sub.sync()
    for args in (["ping"], ["stats"], ["status"], ["list", "layer.*"], ["prefetch", NAMES[3], "--priority", "1"],
                 ["evict", NAMES[3], "--no-wait"], ["flush"], ["set-watermarks", "95%", "0.7"],
                 ["set_watermarks", "95%"]):   # (the op's wire name, as docs/control-plane.md lists it)
        out = ctl(server.endpoint, *args)
        assert out.returncode == 0, (args, out.stderr)
    out = ctl(server.endpoint, "pin", NAMES[3], "--lease", "5")
    assert out.returncode == 0, out.stderr
    lease = json.loads(out.stdout)["lease"]
    for verb in ("renew", "unpin"):
        out = ctl(server.endpoint, verb, lease)
        assert out.returncode == 0, out.stderr
    assert server.counters.errors.get(P.BAD_REQUEST, 0) == bad


# ----------------------------------------------------------------------------- unusable names

@pytest.mark.parametrize("name, why", [("", "is empty"), ("layer.0\0weight", "contains a NUL character"),
                                       ("x" * 2000, "is 2000 bytes; a tensor name is at most 1024"),
                                       ("\ud800", "is not valid UTF-8")])
@pytest.mark.parametrize("op", ["prefetch", "evict", "pin", "flush"])
def test_a_name_no_tensor_can_have_is_a_bad_request_shown_short(served, op, name, why):
    daemon, server, client = served
    before = daemon.tensors(NAMES[0])[0]["state"], daemon.status()["pinned"]
    reply = raw(server.endpoint, op, {"names": [NAMES[0], name]})
    assert reply["ok"] is False and reply["code"] == P.BAD_REQUEST, reply
    assert f"'names'[1]" in reply["reason"] and why in reply["reason"], reply["reason"]
    assert len(reply["reason"]) < 200, reply["reason"]                  # not echoed whole
    assert (daemon.tensors(NAMES[0])[0]["state"], daemon.status()["pinned"]) == before
