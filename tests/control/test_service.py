"""The ZeroMQ control plane against a real Daemon: operations, events, leases,
errors, BUSY, server-side timeouts, and shutdown; clients in other processes
(spawn) where the issue asks for it.

MindSpore is imported inside fixtures only: spawned children import this module
to find their target and must stay light.
"""
import multiprocessing
import os
import secrets
import threading
import time

import pytest
import zmq

from helpers import wait_until
from prefetchd.control import protocol as P
from prefetchd.errors import ConfigError
from prefetchd.errors import (PinnedError, ShutdownError, StorageError, UnknownTensorError)
from prefetchd.control import (BusyError, Client, RequestTimeout, Server, ServiceError,
                               resolve_endpoint, runtime_dir)

N_TENSORS = 8
SHAPE = (64, 256)                    # 64 KiB of float32 each
BUDGET = 1 << 20                     # 16 of them fit; tests need loads, not pressure


def unique_endpoint(tag):
    return f"ipc://t-{tag}-{os.getpid()}-{secrets.token_hex(3)}.sock"


def names(*idx):
    return [f"layer.{i}.weight" for i in idx]


def make_daemon(tmp_path, **overrides):
    import mindspore as ms
    import numpy as np

    import prefetchd

    d = prefetchd.Daemon(device_budget=BUDGET, store_dir=str(tmp_path / "store"),
                         name="svc", **overrides).start()
    for i in range(N_TENSORS):
        d.register(ms.Tensor(np.full(SHAPE, i, np.float32)), name=f"layer.{i}.weight",
                   tier="remote")
    return d


@pytest.fixture
def daemon(tmp_path):
    d = make_daemon(tmp_path)
    yield d
    d.close(5)


@pytest.fixture
def served(daemon):
    server = daemon.serve(unique_endpoint("svc"), default_lease=5.0)
    with Client(server.endpoint, timeout=5.0) as client:
        yield daemon, server, client


def state_of(daemon, name):
    return daemon.tensors(name)[0]["state"]




def server_threads():
    return [t for t in threading.enumerate() if t.name.startswith("prefetchd-server")]


# ----------------------------------------------------------------------------- operations

def test_ping_status_stats_list(served):
    daemon, server, client = served
    pong = client.ping()
    assert pong["pong"] is True and pong["protocol"] == "PFD1" and pong["pid"] == os.getpid()
    assert pong["events"] == server.events_endpoint
    status = client.status()
    assert status["tensors"] == N_TENSORS and status["name"] == "svc"
    assert status["device"]["capacity"] == BUDGET
    assert status["server"]["endpoint"] == server.endpoint
    stats = client.stats()
    assert stats["status"]["tensors"] == N_TENSORS
    assert set(stats["stats"]["requests"]["prefetch"]) >= {"hit", "issued"}
    assert stats["stats"]["transfer_size"]["load"]["buckets"]
    listed = client.list("layer.1*")
    assert [t["name"] for t in listed] == ["layer.1.weight"]
    assert listed[0]["shape"] == list(SHAPE) and listed[0]["nbytes"] == 64 * 256 * 4
    assert len(client.list()) == N_TENSORS
    assert len(client.list(limit=3)) == 3


def test_prefetch_evict_flush_roundtrip(served):
    daemon, server, client = served
    reply = client.prefetch(names(0))
    assert reply["done"] is True and reply["count"] == 1
    assert state_of(daemon, "layer.0.weight") == "resident"
    assert client.prefetch(names(0))["done"] is True          # a hit answers at once
    client.prefetch(names(1))
    client.prefetch(names(2))
    assert client.evict("layer.[12].weight")["count"] == 2     # glob -> pattern
    assert state_of(daemon, "layer.1.weight") == "absent"
    assert state_of(daemon, "layer.2.weight") == "absent"
    queued = client.prefetch(names(5), wait=False)
    assert queued["done"] is False
    assert wait_until(lambda: state_of(daemon, "layer.5.weight") == "resident")
    assert client.flush()["done"] is True
    assert client.set_watermarks(0.9, 0.5) == {"high": 0.9, "low": 0.5}
    assert daemon.status()["device"]["high_watermark"] == int(BUDGET * 0.9)
    assert client.prefetch(pattern="nothing.*")["count"] == 0


def test_many_names_in_one_request(served):
    daemon, server, client = served
    assert client.prefetch(names(3, 4, 6, 7), timeout=3)["count"] == 4
    assert all(state_of(daemon, n) == "resident" for n in names(3, 4, 6, 7))
    lease = client.pin("layer.*", lease=5, timeout=3)
    assert daemon.status()["pinned"] == N_TENSORS
    client.unpin(lease)
    assert wait_until(lambda: daemon.status()["pinned"] == 0)


def test_pin_lease_renew_unpin(served):
    daemon, server, client = served
    lease = client.pin("layer.3.weight", lease=0.4)
    assert daemon.tensors("layer.3.weight")[0]["pins"] == 1
    with pytest.raises(PinnedError) as err:
        client.evict(names(3))
    assert err.value.code == P.PINNED
    for _ in range(4):                                     # 0.8 s, twice the lease
        time.sleep(0.2)
        assert client.renew(lease)["renewed"] == 1
    assert daemon.tensors("layer.3.weight")[0]["pins"] == 1
    assert client.unpin(lease) == {"count": 1}
    assert wait_until(lambda: daemon.tensors("layer.3.weight")[0]["pins"] == 0)
    with pytest.raises(ServiceError) as err:
        client.renew(lease)
    assert err.value.code == P.BAD_REQUEST and "expired or released" in str(err.value)


def test_lease_expires_without_renew(served):
    daemon, server, client = served
    client.pin(names(4), lease=0.3)
    assert daemon.status()["pinned"] == 1
    assert wait_until(lambda: daemon.status()["pinned"] == 0, timeout=3)
    assert server.counters.leases_expired == 1
    assert client.status()["server"]["leases"] == 0


def test_errors_are_typed(served):
    daemon, server, client = served
    with pytest.raises(UnknownTensorError) as err:
        client.prefetch(["no.such.tensor"])
    assert err.value.code == P.UNKNOWN_TENSOR and "no.such.tensor" in str(err.value)
    with pytest.raises(ServiceError) as err:
        client.set_watermarks(2 * BUDGET, 1)
    assert err.value.code == P.BAD_REQUEST
    with pytest.raises(ServiceError) as err:
        client.call("frobnicate")
    assert err.value.code == P.BAD_REQUEST and "unknown op" in str(err.value)
    with pytest.raises(ServiceError) as err:
        client.call("prefetch", names=[1, 2])
    assert err.value.code == P.BAD_REQUEST
    with pytest.raises(ServiceError):
        client.pin(names(1), lease=10 ** 9)
    assert client.ping()["pong"]                              # still serving


def test_storage_error_reply_and_failed_event(served, native_faults):
    daemon, server, client = served
    native_faults.inject_fault("read", "error", count=100, key_contains="layer.6")
    with client.subscribe([b"failed"]) as sub:
        sub.sync()
        with pytest.raises(StorageError) as err:
            client.prefetch(names(6))
        assert err.value.code == P.STORAGE
        event = sub.recv(timeout=3)
    assert event["event"] == "failed" and event["name"] == "layer.6.weight" and event["error"]


def test_events_loaded_evicted_written_back(served):
    import mindspore as ms
    import numpy as np
    daemon, server, client = served
    daemon.register(ms.Tensor(np.ones(SHAPE, np.float32)), name="dirty.0", tier="device")
    with client.subscribe() as sub:
        sub.sync()
        client.prefetch(names(1))
        client.evict(names(1))
        client.flush(["dirty.0"])
        seen = [sub.recv(timeout=3) for _ in range(3)]
    got = {(e["event"], e["name"]) for e in seen}
    assert got == {("loaded", "layer.1.weight"), ("evicted", "layer.1.weight"),
                   ("written_back", "dirty.0")}
    assert [e["seq"] for e in seen] == sorted(e["seq"] for e in seen)
    assert all(e["nbytes"] == 64 * 256 * 4 for e in seen)


def test_server_times_out_a_slow_request_and_keeps_serving(served, native_faults):
    daemon, server, client = served
    native_faults.inject_fault("read", "delay", delay_ms=1500, key_contains="layer.7")
    started = time.monotonic()
    with pytest.raises(RequestTimeout) as err:
        client.prefetch(names(7), timeout=0.6)
    assert time.monotonic() - started < 1.2
    assert err.value.code == P.TIMEOUT and "continues in the daemon" in str(err.value)
    assert server.counters.timeouts == 1
    assert client.ping()["pong"]
    assert wait_until(lambda: state_of(daemon, "layer.7.weight") == "resident", timeout=5)


def test_abandoned_pin_is_released(served, native_faults):
    daemon, server, client = served
    native_faults.inject_fault("read", "delay", delay_ms=800, key_contains="layer.5")
    with pytest.raises(RequestTimeout):
        client.pin(names(5), lease=30, timeout=0.3)
    # The pin lands after the client gave up; nobody holds a lease, so it is dropped.
    assert wait_until(lambda: state_of(daemon, "layer.5.weight") == "resident", timeout=5)
    assert wait_until(lambda: daemon.status()["pinned"] == 0, timeout=3)
    assert client.status()["server"]["leases"] == 0


def test_busy_reply_when_too_many_outstanding(daemon, native_faults):
    native_faults.inject_fault("read", "delay", delay_ms=1000, count=100)
    server = daemon.serve(unique_endpoint("busy"), max_outstanding=2)
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.connect(server.endpoint)
        for i in range(6):
            sock.send_multipart(P.encode_request(P.new_rid(i), "prefetch", {"names": names(i)}))
        codes = {}
        while len(codes) < 6 and sock.poll(5000):
            rid, doc = P.decode_reply(sock.recv_multipart())
            codes[rid] = doc.get("code", "OK")
        assert sorted(codes.values()) == ["BUSY"] * 4 + ["OK"] * 2
        assert server.counters.busy == 4
    finally:
        ctx.destroy(linger=0)
    with Client(server.endpoint) as client:      # BusyError is what a Client raises
        assert client.ping()["pong"]
    assert issubclass(BusyError, ServiceError)


def test_request_to_closed_daemon_gets_shutdown(tmp_path):
    d = make_daemon(tmp_path)
    d.close(5)                           # a closed daemon refuses work with ShutdownError
    server = Server(d, unique_endpoint("shut")).start()
    client = Client(server.endpoint, timeout=2)
    try:
        with pytest.raises(ShutdownError) as err:
            client.prefetch(names(0))
        assert err.value.code == P.SHUTDOWN
    finally:
        client.close()
        server.close(2)


# ----------------------------------------------------------------------------- lifecycle

def test_close_of_daemon_with_busy_server_returns_within_timeout(tmp_path, native_faults,
                                                                 no_leaks):
    d = make_daemon(tmp_path)
    server = d.serve(unique_endpoint("close"))
    native_faults.inject_fault("read", "delay", delay_ms=400, count=1000)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(server.endpoint)
    for i in range(200):
        op = "pin" if i % 3 == 0 else "prefetch"
        sock.send_multipart(P.encode_request(P.new_rid(i), op, {"names": names(i % N_TENSORS)}))
    assert wait_until(lambda: server.counters.requests["pin"] + server.counters.requests["prefetch"]
                      >= 100, timeout=5)
    started = time.monotonic()
    d.close(timeout=2.0)
    elapsed = time.monotonic() - started
    ctx.destroy(linger=0)
    assert elapsed < 2.0 + 1.5, elapsed
    assert not server.running and server.closed
    assert not server_threads()
    assert not os.path.exists(server.endpoint[len("ipc://"):])


def test_server_close_is_bounded_and_leaks_nothing(daemon, no_leaks):
    for _ in range(10):
        server = Server(daemon, unique_endpoint("leak")).start()
        with Client(server.endpoint, timeout=2) as c:
            c.ping()
            c.subscribe().sync()
        started = time.monotonic()
        server.close(2)
        assert time.monotonic() - started < 2
        assert server.closed                     # Context destroyed (linger 0)
        server.close(2)                          # idempotent
    assert not server_threads()


def test_client_reconnects_after_a_timeout(daemon):
    endpoint = unique_endpoint("pirate")
    with Client(endpoint, timeout=0.3) as client:
        with pytest.raises(RequestTimeout):
            client.ping()                    # nobody listens yet
        assert not client.connected          # Lazy Pirate: the socket was dropped
        assert client.reconnects == 1
        server = Server(daemon, endpoint).start()
        try:
            assert client.ping(timeout=5)["pong"]
        finally:
            server.close(2)


def test_server_timeout_reply_keeps_the_socket(served, native_faults):
    daemon, server, client = served
    native_faults.inject_fault("read", "delay", delay_ms=600, key_contains="layer.2")
    client.ping()
    assert client.connected and client.reconnects == 0
    with pytest.raises(RequestTimeout) as err:
        client.prefetch(names(2), timeout=0.3)   # the server gives up first and says so
    assert err.value.code == P.TIMEOUT
    assert client.connected and client.reconnects == 0    # the same socket, not a new one
    assert client.ping()["pong"]


def test_endpoint_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert resolve_endpoint("ipc://") == f"ipc://{tmp_path}/prefetchd/default.sock"
    assert resolve_endpoint("ipc://", "w1") == f"ipc://{tmp_path}/prefetchd/w1.sock"
    assert resolve_endpoint("ipc://ctl.sock") == f"ipc://{tmp_path}/prefetchd/ctl.sock"
    assert resolve_endpoint("ipc:///run/x.sock") == "ipc:///run/x.sock"
    assert resolve_endpoint("tcp://localhost:5555", bind=True) == "tcp://127.0.0.1:5555"
    assert resolve_endpoint("tcp://127.0.0.1:0", bind=True) == "tcp://127.0.0.1:*"
    assert resolve_endpoint("tcp://0.0.0.0:5555", bind=True, allow_remote=True) == \
        "tcp://0.0.0.0:5555"
    # The remedy names every way to set it: `prefetchd serve` has no allow_remote argument.
    with pytest.raises(ConfigError, match="loopback.*PREFETCHD_ALLOW_REMOTE=1.*allow_remote = true"):
        resolve_endpoint("tcp://0.0.0.0:5555", bind=True)
    with pytest.raises(ConfigError, match="longer than"):
        resolve_endpoint("ipc:///" + "x" * 200)
    with pytest.raises(ConfigError):
        resolve_endpoint("inproc://x")
    # libzmq's abstract namespace has no file, so no permission keeps other users out. It
    # became a file named "@x" (ipc://@x), or bound abstract and then failed (ipc://@/x).
    for abstract in ("ipc://@x", "ipc://@/x"):
        with pytest.raises(ConfigError, match="abstract-namespace"):
            resolve_endpoint(abstract, bind=True)
    assert runtime_dir() == f"{tmp_path}/prefetchd"


def test_a_file_at_an_ipc_path_that_is_no_socket_is_refused_not_deleted(daemon, tmp_path):
    # libzmq unlinks whatever is at an ipc path it binds: a user's file was deleted.
    from prefetchd.control.endpoints import check_bind_dir
    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    notes = private / "ctl.txt"
    notes.write_text("mine")
    with pytest.raises(ConfigError, match=f"{notes}: a file that is not a socket is there"):
        check_bind_dir(f"ipc://{notes}")                    # config validate says so first
    with pytest.raises(ConfigError, match=f"{notes}: a file that is not a socket is there"):
        Server(daemon, f"ipc://{notes}").start()
    assert notes.read_text() == "mine" and not server_threads()


def test_second_server_on_a_live_path_is_refused(daemon):
    endpoint = unique_endpoint("dup")
    first = Server(daemon, endpoint).start()
    try:
        with pytest.raises(ConfigError, match="another server"):
            Server(daemon, endpoint).start()
        with Client(first.endpoint) as c:
            assert c.ping()["pong"]
    finally:
        first.close(2)
    assert not server_threads()


def test_a_second_serve_of_one_daemon_is_refused_and_close_stops_the_first(tmp_path):
    # A second serve() once replaced the first server, which then outlived close():
    # still answering, with its thread, descriptors and socket files.
    d = make_daemon(tmp_path)
    first = d.serve(unique_endpoint("one"))
    second_endpoint = unique_endpoint("two")
    with pytest.raises(ConfigError, match="already serving at " + first.endpoint):
        d.serve(second_endpoint)
    assert not os.path.exists(second_endpoint[len("ipc://"):])
    first.close(2)                                    # a closed one may be replaced
    first = d.serve(second_endpoint)
    with Client(first.endpoint) as c:
        assert c.ping()["pong"]
    d.close(5)
    assert first.closed and not server_threads()
    assert not os.path.exists(first.endpoint[len("ipc://"):])


def test_a_busy_tcp_port_is_refused_naming_the_endpoint(daemon):
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with pytest.raises(ConfigError, match=f"endpoint {endpoint}: Address already in use "
                                              r"\(another process listens on that port"):
            Server(daemon, endpoint).start()
    assert not server_threads()


def test_a_request_over_four_times_the_limit_times_out_saying_why(served):
    # libzmq drops a message over the router's maxmsgsize (4x max_message_size) unanswered.
    daemon, server, client = served
    many = [f"layer.{i}.weight" + "x" * 1000 for i in range(5000)]     # ~5 MB of names
    with pytest.raises(RequestTimeout, match=r"the request was \d+ bytes.*over 4x its max_message_size"):
        client.prefetch(many, timeout=1.0)
    assert client.ping()["pong"]


# ----------------------------------------------------------------------------- other processes

def _child_client(endpoint, out):
    """Runs in a spawned process: subscribe, prefetch, read status, collect events."""
    from prefetchd.control import Client
    try:
        with Client(endpoint, timeout=10) as c:
            sub = c.subscribe([b"loaded", b"evicted"]).sync()
            c.prefetch(["layer.1.weight"])
            c.prefetch(["layer.2.weight"])
            c.evict(["layer.1.weight"])
            events = [sub.recv(timeout=5) for _ in range(3)]
            status = c.status()
            out.put({"pid": os.getpid(), "events": events, "status": status,
                     "pong": c.ping()})
    except BaseException as e:  # noqa: BLE001 - report to the parent
        out.put({"error": repr(e)})


def _child_pinner(endpoint, out, lease):
    """Runs in a spawned process: pin with a lease, report it, then hang until killed."""
    from prefetchd.control import Client
    c = Client(endpoint, timeout=10)
    out.put(c.pin(["layer.4.weight"], lease=lease))
    time.sleep(600)


def test_client_in_another_process(served):
    daemon, server, client = served
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child_client, args=(server.endpoint, out), daemon=True)
    child.start()
    try:
        result = out.get(timeout=60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert "error" not in result, result
    assert result["pid"] != os.getpid() and result["pong"]["pid"] == os.getpid()
    kinds = [(e["event"], e["name"]) for e in result["events"]]
    assert kinds == [("loaded", "layer.1.weight"), ("loaded", "layer.2.weight"),
                     ("evicted", "layer.1.weight")]
    assert result["status"]["states"]["resident"] >= 1
    assert state_of(daemon, "layer.2.weight") == "resident"


def test_dead_clients_pins_expire(served):
    daemon, server, client = served
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child_pinner, args=(server.endpoint, out, 1.0), daemon=True)
    child.start()
    try:
        lease = out.get(timeout=60)
        assert daemon.tensors("layer.4.weight")[0]["pins"] == 1
    finally:
        child.kill()
        child.join(10)
    assert child.exitcode is not None
    killed_at = time.monotonic()
    assert wait_until(lambda: daemon.tensors("layer.4.weight")[0]["pins"] == 0, timeout=5)
    assert time.monotonic() - killed_at < 2.5
    assert server.counters.leases_expired == 1
    with pytest.raises(ServiceError):
        client.renew(lease)
    client.evict(names(4))                   # no longer pinned


# ----------------------------------------------------------------------------- CLI

def test_cli_status_ctl_keys(served, tmp_path, capsys):
    import json

    from prefetchd.cli import main
    daemon, server, client = served
    ep = ["--endpoint", server.endpoint]
    assert main(["status", *ep]) == 0
    out = capsys.readouterr().out
    assert "daemon   svc" in out and f"tensors  {N_TENSORS}" in out
    assert main(["status", *ep, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"] == N_TENSORS
    assert main(["ctl", *ep, "prefetch", "layer.[01].weight"]) == 0
    assert json.loads(capsys.readouterr().out)["count"] == 2
    assert state_of(daemon, "layer.1.weight") == "resident"
    assert main(["ctl", *ep, "pin", "layer.0.weight", "--lease", "5"]) == 0
    lease = json.loads(capsys.readouterr().out)["lease"]
    assert main(["ctl", *ep, "evict", "layer.0.weight"]) == 1          # pinned: refused
    assert "pinned" in capsys.readouterr().err
    assert main(["ctl", *ep, "unpin", lease]) == 0
    capsys.readouterr()
    # renew's new length (the CLI could not pass it: a second argument was taken for a lease id)
    assert main(["ctl", *ep, "pin", "layer.0.weight"]) == 0
    lease = json.loads(capsys.readouterr().out)["lease"]
    assert main(["ctl", *ep, "renew", lease, "--lease", "0.3"]) == 0
    assert json.loads(capsys.readouterr().out)["renewed"] == 1
    assert wait_until(lambda: daemon.status()["pinned"] == 0, 5)       # not the default 30 s
    assert main(["ctl", *ep, "set-watermarks", "0.9", "0.6"]) == 0
    assert main(["ctl", *ep, "list", "layer.1*"]) == 0
    capsys.readouterr()
    assert main(["ctl", "--endpoint", unique_endpoint("nobody"), "--timeout", "0.2", "ping"]) == 1
    assert "the socket file does not exist" in capsys.readouterr().err     # said at once
    assert main(["ctl", "--endpoint", "tcp://127.0.0.1:1", "--timeout", "0.2", "ping"]) == 1
    assert "no reply" in capsys.readouterr().err
    keys = tmp_path / "keys"
    assert main(["keys", str(keys), "--client", "alice"]) == 0
    assert (keys / "server.key_secret").exists() and (keys / "authorized_clients" / "alice.key").exists()


def test_an_events_socket_path_over_the_limit_is_refused_naming_it(tmp_path, make_daemon):
    """The control endpoint's path fit sun_path, the events socket made beside it did not, and
    libzmq's bind failed with only 'ipc path "..."' (a serve worker under a long
    $XDG_RUNTIME_DIR could not start, saying nothing of why)."""
    base = f"{tmp_path}/"
    if len(base) > 90:
        pytest.skip("tmp_path itself is too long to build the case")
    path = base + "c" * (104 - len(base) - len(".sock")) + ".sock"          # 104 bytes: fits
    with pytest.raises(ConfigError, match=r"events socket .*-events\.sock is longer than 107 bytes"):
        make_daemon(endpoint=f"ipc://{path}")
