"""Peers without an authorized CURVE key cannot starve a CURVE endpoint: ~1,100 tcp
connections that never finish a handshake (reopened as fast as they are dropped) and
hundreds of DEALERs with unauthorized keys, all from the authorized client's own
address, at a 256-descriptor limit. The authorized client is still served, the store
still reads and writes, the descriptors stay under the limit.

Before, a tcp connection counted against its address's budget from the accept on:
the flood held that budget, and the authorized client's connections were the ones
dropped (prefetchd/control/handshakes.py). The daemon runs in a child
(tests/control/_fd_limited_daemon.py) with the lowered limit."""
import os
import subprocess
import sys
import textwrap
import time

from prefetchd.control import Client, create_keys
from _floods import RAW_KEEPER
from test_connection_limits import ROOT, child  # noqa: F401  (the fixture)

BAD_KEYS = textwrap.dedent("""
    import sys, time, zmq
    endpoint, server_key, n, hold = sys.argv[1], sys.argv[2].encode(), int(sys.argv[3]), float(sys.argv[4])
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, n + 16)
    socks = []
    for _ in range(n):
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.reconnect_ivl = 10                 # retry fast after each refusal
        s.curve_serverkey = server_key
        s.curve_publickey, s.curve_secretkey = zmq.curve_keypair()   # a key nobody authorized
        s.connect(endpoint)
        socks.append(s)
    print("flooded", n, flush=True)
    time.sleep(hold)
    ctx.destroy(linger=0)
""")


def test_unauthenticated_floods_do_not_starve_authorized_clients_or_the_store(child, tmp_path):
    keys = create_keys(str(tmp_path / "keys"))
    d = child(256, 256, endpoint="tcp://127.0.0.1:0", curve_keys_dir=keys)
    host, port = d.endpoint[len("tcp://"):].rsplit(":", 1)
    with open(os.path.join(keys, "server.key")) as f:
        server_key = next(line.split('"')[1] for line in f if "public-key" in line)
    env = dict(os.environ, PYTHONPATH=ROOT)
    floods = [subprocess.Popen([sys.executable, "-c", RAW_KEEPER, host, port, "1100", "40"],
                               stdout=subprocess.PIPE, text=True, env=env),
              subprocess.Popen([sys.executable, "-c", BAD_KEYS, d.endpoint, server_key, "300", "40"],
                               stdout=subprocess.PIPE, text=True, env=env)]
    try:
        for flood in floods:
            assert flood.stdout.readline().startswith("flooded")
        time.sleep(1.0)
        for _ in range(10):
            started = time.monotonic()
            with Client(d.endpoint, timeout=5, server_public_key=os.path.join(keys, "server.key"),
                        client_keys=os.path.join(keys, "client.key_secret")) as c:
                assert c.ping()["pong"] is True, "the authorized client was not served"
                server = c.status()["server"]
            assert time.monotonic() - started < 5.0
            # Connections let in: this client's (and a leftover one closing); the flood's are
            # all still in their handshake, at most 32 (a quarter of the admit line) at once.
            assert server["connections"] - server["connections_handshaking"] <= 3, server
            assert server["connections_handshaking"] <= 32, server
            assert d.ask("check").startswith("ok"), "the store failed under the flood"
            fds, held, soft = map(int, d.ask("fds").split()[1:])
            assert soft == 256 and fds < 256, (fds, held, soft)
            time.sleep(0.2)
        assert all(f.poll() is None for f in floods), "a flood ended early: it did not load the server"
        assert d.alive()
    finally:
        for flood in floods:
            flood.kill()
            flood.wait(10)
    assert d.close() == 0
