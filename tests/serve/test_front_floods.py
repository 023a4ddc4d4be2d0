"""`prefetchd serve`'s front on tcp under a connection flood: ~1,100 raw tcp connections
that never speak, reopened as fast as they are dropped, at a 256-descriptor limit. The
front bounds its clients' connections like the daemon's server
(prefetchd/control/connections.py): it stays up, keeps its descriptors under the limit
and answers a client throughout. The front runs in a child with the lowered limit."""
import os
import selectors
import subprocess
import sys
import textwrap
import time

from _floods import RAW_KEEPER
from prefetchd.control import Client

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FRONT = textwrap.dedent("""
    import os, resource, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    from prefetchd.serve import Front, ServeSpec
    spec = ServeSpec(store_dir=sys.argv[1], models=1, hidden=64, layers=2, batch=2, seq=8, lookahead=1)
    front = Front("tcp://127.0.0.1:0", workers=1, spec=spec, request_timeout=20.0, name="flooded").start()
    print("ready", front.endpoint, flush=True)
    for line in sys.stdin:
        if line.strip() == "fds":
            print("fds", len(os.listdir("/proc/self/fd")), flush=True)
        else:
            break
    front.close(10)
    print("closed", flush=True)
""")

def _line(proc, timeout):
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if sel.select(timeout):
            return proc.stdout.readline().strip()
    raise AssertionError(f"no line from the child within {timeout}s (rc {proc.poll()})")


def test_a_connection_flood_does_not_take_the_front_down_or_starve_its_clients(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    front = subprocess.Popen([sys.executable, "-c", FRONT, str(tmp_path)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    flood = None
    try:
        ready = _line(front, 180)
        assert ready.startswith("ready tcp://"), ready
        endpoint = ready.split()[1]
        host, port = endpoint[len("tcp://"):].rsplit(":", 1)
        flood = subprocess.Popen([sys.executable, "-c", RAW_KEEPER, host, port, "1100", "30"],
                                 stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert _line(flood, 120).startswith("flooded")
        except AssertionError:
            raise AssertionError("the flood's connections were not accepted within 120 s: the front "
                                 "ran out of descriptors and stopped accepting") from None
        time.sleep(1.0)
        for _ in range(8):
            started = time.monotonic()
            with Client(endpoint, timeout=5) as c:
                assert c.ping()["pong"] is True, "the front did not answer under the flood"
                status = c.status()
            assert time.monotonic() - started < 10.0
            assert status["front"]["connections_handshaking"] <= 32, status["front"]
            front.stdin.write("fds\n")
            front.stdin.flush()
            fds = int(_line(front, 30).split()[1])
            assert fds < 256, fds
            time.sleep(0.2)
        assert flood.poll() is None, "the flood ended early: it did not load the front"
        assert front.poll() is None, "the front died under the flood"
    finally:
        if flood is not None:
            flood.kill()
            flood.wait(10)
        if front.poll() is None:
            front.stdin.write("quit\n")
            front.stdin.flush()
            try:
                assert _line(front, 60) == "closed"
            finally:
                front.wait(30)
        else:
            front.wait(30)
    assert front.returncode == 0
