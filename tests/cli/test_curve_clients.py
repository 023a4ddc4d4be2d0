"""Named CURVE clients from the shell: every `connect with:` line `prefetchd keys DIR
--client NAME ...` prints works as printed (it named DIR/client.key_secret, which named
clients do not have), `status`/`ctl --client NAME` pick DIR/NAME.key_secret, and a
missing certificate is named with the key files DIR does hold. A real Daemon serving
CURVE on tcp, the real `prefetchd` command in subprocesses."""
import json
import os
import shlex
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRINTED_ENDPOINT = "tcp://127.0.0.1:5555"


def run(*args):
    return subprocess.run([sys.executable, "-m", "prefetchd.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=60, env={**os.environ, "PYTHONPATH": REPO})


@pytest.fixture(scope="module")
def keys_and_server(tmp_path_factory, mindspore_cpu):
    import numpy as np

    import prefetchd
    base = tmp_path_factory.mktemp("curve")
    keys = str(base / "keys")
    made = run("keys", keys, "--client", "alice", "--client", "bob")
    assert made.returncode == 0, made.stderr
    d = prefetchd.Daemon(device_budget=1 << 20, store_dir=str(base / "store"), name="curvecli").start()
    d.register(mindspore_cpu.Tensor(np.ones((64, 64), np.float32)), name="w", tier="remote")
    server = d.serve("tcp://127.0.0.1:0", curve_keys_dir=keys)
    yield keys, made.stdout, server
    d.close(5)


@pytest.fixture
def daemon_of(keys_and_server):
    return keys_and_server[2].daemon


def test_every_printed_connect_line_works_for_its_client(keys_and_server):
    keys, printed, server = keys_and_server
    lines = [line.split("connect with: ", 1)[1] for line in printed.splitlines()
             if line.startswith("connect with: ")]
    assert len(lines) == 2 and all(PRINTED_ENDPOINT in line for line in lines), printed
    for client, line in zip(("alice", "bob"), lines):
        argv = shlex.split(line.replace(PRINTED_ENDPOINT, server.endpoint))
        assert argv[:2] == ["prefetchd", "status"] and argv[-2:] == ["--client", client], argv
        out = run(*argv[1:], "--json")
        assert out.returncode == 0, (line, out.stderr)
        assert json.loads(out.stdout)["server"]["curve"] is True
    out = run("ctl", "--endpoint", server.endpoint, "--curve-dir", keys, "--client", "bob", "list")
    assert out.returncode == 0, out.stderr
    assert [t["name"] for t in json.loads(out.stdout)] == ["w"]


def test_the_default_client_connects_as_printed_without_client(tmp_path, daemon_of):
    from prefetchd.control import Server
    keys = str(tmp_path / "default")
    made = run("keys", keys)
    assert made.returncode == 0 and "--client" not in made.stdout, made.stdout
    line = next(x for x in made.stdout.splitlines() if x.startswith("connect with: "))
    with Server(daemon_of, "tcp://127.0.0.1:0", curve_keys_dir=keys) as server:
        argv = shlex.split(line.split(": ", 1)[1].replace(PRINTED_ENDPOINT, server.endpoint))
        out = run(*argv[1:])
        assert out.returncode == 0 and "daemon   curvecli" in out.stdout, (line, out.stderr)


def test_a_missing_client_certificate_names_the_key_files_there(keys_and_server):
    keys, _, server = keys_and_server
    for extra, missing in (((), "client.key_secret"), (("--client", "carol"), "carol.key_secret")):
        out = run("status", "--endpoint", server.endpoint, "--curve-dir", keys, *extra)
        assert out.returncode == 1, out.stderr
        line = out.stderr.strip()
        assert f"no {missing} in it" in line and "alice.key_secret" in line and "bob.key_secret" in line
        assert "--client NAME, one of alice, bob" in line, line
        assert "not a directory made by" not in line, line


def test_client_needs_a_curve_dir_and_a_plain_name(keys_and_server):
    keys, _, server = keys_and_server
    out = run("status", "--endpoint", server.endpoint, "--client", "alice")
    assert out.returncode == 2 and "give --curve-dir too" in out.stderr, out.stderr
    out = run("ctl", "--endpoint", server.endpoint, "--curve-dir", keys, "--client", "../alice", "ping")
    assert out.returncode == 2 and "plain name" in out.stderr, out.stderr
