"""Connection floods cannot take the daemon's process down: at a low RLIMIT_NOFILE the
server drops connections beyond its budgets (per peer, in all, a descriptor reserve for
the store) instead of letting libzmq abort the process, and the store keeps working.

The daemon runs in a child (tests/control/_fd_limited_daemon.py) with the lowered
limit; floods come from other processes: raw unix-socket connects that never speak
ZMTP, and ZeroMQ DEALERs that reconnect whenever they are dropped."""
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time

import pytest
import zmq

from prefetchd.control import Client

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


class Child:
    def __init__(self, tmp_path, soft, hard=None, endpoint=None, curve_keys_dir=None):
        sock_dir = tmp_path / "sock"
        sock_dir.mkdir(mode=0o700)
        (tmp_path / "store").mkdir()
        endpoint = endpoint or f"ipc://{sock_dir}/d-{secrets.token_hex(3)}.sock"
        argv = [sys.executable, os.path.join(HERE, "_fd_limited_daemon.py"), endpoint,
                str(tmp_path / "store"), str(soft), str(hard or 0)] + ([curve_keys_dir] if curve_keys_dir else [])
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=ROOT)
        line = self.ask(None, 60)
        assert line.startswith("ready "), line
        self.endpoint = line.split()[1]

    def ask(self, command, timeout=30):
        if command is not None:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        import selectors
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(deadline - time.monotonic()):
                    return self.proc.stdout.readline().strip()
        raise AssertionError(f"no answer to {command!r} within {timeout}s (rc {self.proc.poll()})")

    def alive(self):
        return self.proc.poll() is None

    def close(self):
        if self.alive():
            try:
                assert self.ask("quit", 30) == "closed"
            finally:
                self.proc.stdin.close()
        return self.proc.wait(30)

    def kill(self):
        if self.alive():
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def child(tmp_path):
    made = []

    def make(soft, hard=None, **kwargs):
        made.append(Child(tmp_path, soft, hard, **kwargs))
        return made[-1]
    yield make
    for c in made:
        c.kill()


RAW_FLOOD = textwrap.dedent("""
    import socket, sys, time
    path, n, hold, pace = sys.argv[1][len("ipc://"):], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    socks = []
    for i in range(n):
        if pace and i % pace == 0:
            time.sleep(0.01)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            socks.append(s)
        except OSError:
            s.close()
    print("flooded", len(socks), flush=True)
    time.sleep(hold)
""")


def raw_flood(endpoint, n, hold, pace=0):
    """n connects that never speak ZMTP, held `hold` seconds; `pace`: 10 ms pause per that many."""
    return subprocess.Popen([sys.executable, "-c", RAW_FLOOD, endpoint, str(n), str(hold), str(pace)],
                            stdout=subprocess.PIPE, text=True)


def ping_from_another_process(endpoint):
    code = ("import sys; from prefetchd.control import Client\n"
            "with Client(sys.argv[1], timeout=10) as c: print(c.ping()['pong'])")
    out = subprocess.run([sys.executable, "-c", code, endpoint], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
    return out.stdout.strip(), out.stderr[-2000:]


def open_fds():
    return len(os.listdir("/proc/self/fd"))


def dealers(ctx, endpoint, n, pace=0):
    """n DEALERs (reconnecting whenever dropped); `pace`: 10 ms pause per that many."""
    out = []
    for i in range(n):
        if pace and i % pace == 0:
            time.sleep(0.01)
        s = ctx.socket(zmq.DEALER)
        s.linger = 0
        s.connect(endpoint)
        out.append(s)
    return out


def test_floods_at_a_256_descriptor_limit_are_dropped_and_the_store_keeps_working(child):
    d = child(256, 256)             # the hard limit too: the server cannot raise it
    # Paced: 1,200 connects in ~0.25 s. An unpaced burst of more than the reserve can
    # still outrun the guard at a hard limit this low (see prefetchd/control/connections.py).
    flood = raw_flood(d.endpoint, 1200, 30, pace=50)
    ctx = zmq.Context()
    try:
        assert flood.stdout.readline().startswith("flooded")
        held_open = dealers(ctx, d.endpoint, 200, pace=10)   # dropped ones keep reconnecting
        time.sleep(1.0)
        assert d.alive(), f"the daemon died under the flood (rc {d.proc.returncode})"
        assert d.ask("check").startswith("ok"), "the store failed at the descriptor limit"
        fds, held, soft = map(int, d.ask("fds").split()[1:])
        # two peers' budgets, and those waiting over them for a first request (32 at this limit)
        assert soft == 256 and fds < 256 and held <= 2 * 32 + 32 + 8, (fds, held, soft)
        # A third process still gets served: one peer cannot take every slot.
        pong, err = ping_from_another_process(d.endpoint)
        assert pong == "True", err
        # This process is at its per-peer budget: its new connections are the ones dropped.
        ctx.destroy(linger=0)
        del held_open
        time.sleep(0.5)
        # A monitor opening a Client per poll, closed or merely dropped: nothing piles up
        # (the raw flood from the other process still holds its share).
        before = open_fds()
        for i in range(1100):
            if i % 2:
                with Client(d.endpoint, timeout=10) as c:
                    c.status()
            else:
                Client(d.endpoint, timeout=10).status()     # dropped without close()
        assert open_fds() <= before + 4, "Clients leaked descriptors in the client's process"
        assert d.alive() and d.ask("check").startswith("ok")
        fds, held, soft = map(int, d.ask("fds").split()[1:])
        assert fds < 256 and held <= 32 + 32 + 8, (fds, held)
    finally:
        ctx.destroy(linger=0)
        flood.kill()
        flood.wait(10)
    assert d.close() == 0


def test_unpaced_parallel_floods_at_a_low_soft_limit(child):
    d = child(256)                  # the hard limit stays: the server raises the soft one
    floods = [raw_flood(d.endpoint, 1000, 20) for _ in range(4)]
    ctx = zmq.Context()
    ctx.setsockopt(zmq.MAX_SOCKETS, 2048)
    try:
        for f in floods:
            assert f.stdout.readline().startswith("flooded")
        many = dealers(ctx, d.endpoint, 1000)
        time.sleep(1.0)
        assert d.alive(), f"the daemon died under the flood (rc {d.proc.returncode})"
        fds, held, soft = map(int, d.ask("fds").split()[1:])
        assert soft > 256 and held <= 5 * 64 + 64, (fds, held, soft)     # and 64 waiting
        assert d.ask("check").startswith("ok")
        del many
    finally:
        ctx.destroy(linger=0)
        for f in floods:
            f.kill()
            f.wait(10)
    assert d.close() == 0


def test_a_client_connected_before_a_pause_is_answered_through_it(child):
    """With descriptors short (here taken by something else in the daemon's process), the
    server stops listening: an ipc endpoint used to be unbound, which discarded the pipes of
    the clients connected to it (their requests read and dropped, each waiting out its
    timeout). Now its socket file is moved aside: a connected client is answered throughout,
    a new one gets in once descriptors are back."""
    d = child(256, 256)
    with Client(d.endpoint, timeout=10) as c:
        c.ping()
        assert d.ask("hog 250").startswith("hogging")
        # A new connection is accepted, seen over the line, dropped, and the server pauses.
        # (It is held open: one closed before the guard looked would not count.)
        newcomer = subprocess.Popen([sys.executable, "-c", RAW_FLOOD, d.endpoint, "1", "5", "0"],
                                    stdout=subprocess.PIPE, text=True)
        assert newcomer.stdout.readline().startswith("flooded")
        deadline = time.monotonic() + 10
        while d.ask("pauses") == "pauses 0":
            assert time.monotonic() < deadline, "the server never paused"
            time.sleep(0.05)
        for _ in range(20):                    # each fails with a timeout if the pipe was discarded
            server = c.status()["server"]
            assert server["connections"] >= 1 and server["listening_paused"], server
        assert server["listening_pauses"] >= 1 and server["listening_stuck"] == []
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with pytest.raises(FileNotFoundError):
            probe.connect(d.endpoint[len("ipc://"):])       # a new client finds nothing
        probe.close()
        assert d.ask("unhog").startswith("unhogged")
        pong, err = ping_from_another_process(d.endpoint)
        assert pong == "True", err
        assert c.ping()["pong"] and not c.status()["server"]["listening_paused"]
        newcomer.kill()
        newcomer.wait(10)
    assert d.alive()
    assert d.close() == 0


def test_descriptors_taken_by_the_application_stop_the_listeners_before_anyone_connects(child):
    """The guard looked at the descriptors only when it accepted a connection, so a burst
    arriving after the application had taken them was accepted into the last ones first
    (libzmq aborts at the limit). Now it looks at least once a second, connects or not."""
    d = child(256, 256)
    path = d.endpoint[len("ipc://"):]
    assert d.ask("hog 250").startswith("hogging")
    deadline = time.monotonic() + 5
    while d.ask("pauses") == "pauses 0":
        assert time.monotonic() < deadline, "the server did not pause with no connection"
        time.sleep(0.05)
    assert not os.path.exists(path)
    assert d.ask("unhog").startswith("unhogged")
    deadline = time.monotonic() + 5
    while not os.path.exists(path):
        assert time.monotonic() < deadline, "the server did not resume"
        time.sleep(0.05)
    pong, err = ping_from_another_process(d.endpoint)
    assert pong == "True", err
    assert d.close() == 0


def test_a_low_hard_descriptor_limit_is_warned_about_at_start():
    # At a hard limit of 256, 2,000 connects at once reach it before the guard sheds them
    # and libzmq's ipc listener aborts the process (an outside probe): say so as it starts.
    code = ("import logging, resource\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
            "logging.basicConfig(level=logging.WARNING)\n"
            "from prefetchd.control.descriptors import raise_fd_limit\n"
            "print(raise_fd_limit())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "256", out.stderr
    assert "the descriptor limit is 256 (hard 256)" in out.stderr and "LimitNOFILE" in out.stderr, out.stderr
    code = code.replace("(256, 256)", "(1024, 8192)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "8192" and "descriptor limit is" not in out.stderr, out.stderr
