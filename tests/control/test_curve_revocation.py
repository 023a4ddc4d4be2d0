"""authorized_clients/ is read as it is now, not as it was at the server's start: a key
removed there is refused to new connections at once and its connected client is no
longer answered (its connection shut down), and a key added while the server runs is
admitted without a restart. A real Daemon and CURVE Server on tcp, real clients."""
import os
import shutil

import pytest

from helpers import wait_until
from prefetchd.control import Client, RequestTimeout, Server
from prefetchd.control.keys import AUTHORIZED_DIR, create_keys


@pytest.fixture
def curve(tmp_path, mindspore_cpu):
    import numpy as np

    import prefetchd
    keys = str(tmp_path / "keys")
    create_keys(keys, ["alice", "bob"])
    d = prefetchd.Daemon(device_budget=1 << 20, store_dir=str(tmp_path / "store"), name="revoke").start()
    d.register(mindspore_cpu.Tensor(np.ones((64, 64), np.float32)), name="w", tier="remote")
    server = Server(d, "tcp://127.0.0.1:0", curve_keys_dir=keys).start()
    yield keys, server
    server.close(2)
    d.close(5)


def client(keys, server, who, timeout=5.0):
    return Client(server.endpoint, timeout=timeout, server_public_key=os.path.join(keys, "server.key"),
                  client_keys=os.path.join(keys, f"{who}.key_secret"))


def answered(keys, server, who):
    with client(keys, server, who, timeout=1.5) as c:
        try:
            return c.ping()["pong"]
        except RequestTimeout:
            return False


def test_a_removed_key_is_refused_and_its_connected_client_dropped(curve):
    keys, server = curve
    authorized = os.path.join(keys, AUTHORIZED_DIR)
    with client(keys, server, "bob") as bob, client(keys, server, "alice") as alice:
        assert bob.ping()["pong"] and alice.ping()["pong"]
        shutil.move(os.path.join(authorized, "bob.key"), os.path.join(keys, "bob.key.revoked"))

        assert not answered(keys, server, "bob")                # a new connection: ZAP refuses it
        bob.timeout = 1.5
        with pytest.raises(RequestTimeout):                     # the connected one: unanswered
            bob.ping()
        assert server.counters.revoked >= 1
        assert alice.ping()["pong"] and answered(keys, server, "alice")   # others served on
        st = alice.status()["server"]
        assert st["requests_revoked"] >= 1 and st["connections_dropped"] >= 1, st

        shutil.move(os.path.join(keys, "bob.key.revoked"), os.path.join(authorized, "bob.key"))
        assert answered(keys, server, "bob")                    # authorized again: no restart


def test_a_key_added_while_the_server_runs_is_admitted(curve):
    keys, server = curve
    assert answered(keys, server, "bob")
    create_keys(keys, ["carol"])                                # what `prefetchd keys DIR --client carol` does
    assert answered(keys, server, "carol")
    with client(keys, server, "carol") as carol:
        assert carol.call("list") and carol.status()["server"]["curve"] is True


def test_a_key_file_rewritten_in_place_takes_effect(curve):
    """Overwriting alice.key with carol's public key leaves the directory's mtime alone:
    new connections are checked at once, a connected alice within a second or so."""
    keys, server = curve
    create_keys(os.path.join(keys, "spare"), ["carol"])
    spare = os.path.join(keys, "spare")
    with client(keys, server, "alice") as alice:
        assert alice.ping()["pong"]
        with open(os.path.join(spare, "carol.key"), "rb") as src, \
                open(os.path.join(keys, AUTHORIZED_DIR, "alice.key"), "wb") as dst:
            dst.write(src.read())
        assert not answered(keys, server, "alice")
        alice.timeout = 1.0
        assert wait_until(lambda: _refused(alice), timeout=5)
    with Client(server.endpoint, timeout=3, server_public_key=os.path.join(keys, "server.key"),
                client_keys=os.path.join(spare, "carol.key_secret")) as carol:
        assert carol.ping()["pong"]


def _refused(c):
    try:
        c.ping()
        return False
    except RequestTimeout:
        return True
