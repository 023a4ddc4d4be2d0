"""prefetchd.serve.Client without a server (every future completes: timeout,
close) and the serving session of docs/control-plane.md (`prefetchd serve`, the
Client, `prefetchd infer`), run as written against a real `prefetchd serve`."""
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from helpers import ENV, REPO
from prefetchd.control import ConnectionLost, RequestTimeout
from prefetchd.errors import ShutdownError
from prefetchd.serve import Client


def _nobody(tmp_path):
    return f"ipc://{tmp_path}/nobody.sock"


def test_a_request_nobody_answers_times_out_in_bounded_time(tmp_path):
    with Client(_nobody(tmp_path)) as c:
        started = time.monotonic()
        f = c.submit("m0", np.zeros((1, 4), np.float32), timeout=0.5)
        with pytest.raises(RequestTimeout):
            f.result(5)
        assert time.monotonic() - started < 2
        with pytest.raises(RequestTimeout, match=r"within 0\.3s; no server accepted the connection meanwhile"):
            c.infer("m0", np.zeros((1, 4), np.float32), timeout=0.3)


# A server that takes one request, says so, and never answers (until it is killed).
SILENT_SERVER = """
import sys, zmq
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("up", flush=True)
sock.recv_multipart()
print("got", flush=True)
sys.stdin.readline()
"""


def test_a_request_whose_server_dies_fails_at_once_not_at_its_timeout(tmp_path):
    """kill -9 of the server (a front that crashed) with a request outstanding: the client
    waited out the request's whole timeout for a reply that could no longer come."""
    endpoint = f"ipc://{tmp_path}/dies.sock"
    server = subprocess.Popen([sys.executable, "-c", SILENT_SERVER, endpoint], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        with Client(endpoint) as c:
            f = c.submit("m0", np.zeros((1, 4), np.float32), timeout=120)
            assert server.stdout.readline().strip() == "got"
            started = time.monotonic()
            server.kill()
            with pytest.raises(ConnectionLost, match=r"dies\.sock was lost with the request outstanding.*may have run"):
                f.result(60)
            assert time.monotonic() - started < 10
            with pytest.raises(RequestTimeout, match=r"the connection has been down for \d"):
                c.infer("m0", np.zeros((1, 4), np.float32), timeout=0.5)   # nobody back since
    finally:
        server.kill()
        server.wait(30)


# A server that takes N requests, answers every one when told, then closes (delivering all).
ANSWERING_SERVER = """
import json, sys, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
sock.sndhwm = sock.rcvhwm = 100000
sock.bind(sys.argv[1])
print("up", flush=True)
requests = [sock.recv_multipart() for _ in range(int(sys.argv[2]))]
print("got", flush=True)
sys.stdin.readline()
for frames in requests:
    sock.send_multipart([frames[0], b"PFD1", frames[2], json.dumps({"ok": True, "result": {"outputs": []}}).encode()])
sock.close(linger=-1)
ctx.term()
print("closed", flush=True)
"""
BURST_CLIENT = """
import collections, sys
import numpy as np
from prefetchd.serve import Client
with Client(sys.argv[1], timeout=120) as c:
    futures = [c.submit("m0", np.zeros((1, 4), np.float32)) for _ in range(int(sys.argv[2]))]
    print("sent", flush=True)
    print(dict(collections.Counter(type(f.exception(120)).__name__ for f in futures)), flush=True)
"""


def test_replies_that_came_before_the_connection_closed_are_answers_not_losses(tmp_path):
    """A server answered 1000 requests and closed while the client was descheduled: the
    client read 256 replies a round, saw the disconnect, and failed the other 488 as
    ConnectionLost though their replies were queued (a review of the change above)."""
    endpoint, n = f"ipc://{tmp_path}/burst.sock", 1000
    (tmp_path / "server.py").write_text(ANSWERING_SERVER)
    (tmp_path / "client.py").write_text(BURST_CLIENT)
    server = subprocess.Popen([sys.executable, str(tmp_path / "server.py"), endpoint, str(n)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    client = None
    try:
        assert server.stdout.readline().strip() == "up"
        client = subprocess.Popen([sys.executable, str(tmp_path / "client.py"), endpoint, str(n)],
                                  stdout=subprocess.PIPE, text=True, env=ENV)
        assert server.stdout.readline().strip() == "got"
        os.kill(client.pid, signal.SIGSTOP)           # replies and the close arrive meanwhile
        server.stdin.write("go\n")
        server.stdin.flush()
        time.sleep(2)
        os.kill(client.pid, signal.SIGCONT)
        assert server.stdout.readline().strip() == "closed"
        out, _ = client.communicate(timeout=120)
        assert out.splitlines()[-1] == str({"NoneType": n}), out
    finally:
        for proc in (server, client):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_inputs_over_the_tensor_limit_are_refused_before_sending(tmp_path):
    """The server drops such a request (or its frame) unanswered: the client waited out its
    whole timeout and said only 'no reply'."""
    from prefetchd.control.codes import BadArguments
    with Client(_nobody(tmp_path), max_tensor_bytes=1024) as c:
        started = time.monotonic()
        with pytest.raises(BadArguments, match="over max_tensor_bytes 1024"):
            c.submit("m0", np.zeros((1, 257), np.float32), timeout=30)
        assert time.monotonic() - started < 1
        c.submit("m0", np.zeros((1, 256), np.float32), timeout=0.2)     # at the limit: sent


def test_close_fails_every_outstanding_future(tmp_path):
    c = Client(_nobody(tmp_path))
    futures = [c.submit("m0", np.zeros((1, 4), np.float32), timeout=60) for _ in range(5)]
    started = time.monotonic()
    c.close()
    assert time.monotonic() - started < 6
    for f in futures:
        with pytest.raises(ShutdownError):
            f.result(1)
    with pytest.raises(ShutdownError):
        c.submit("m0", np.zeros((1, 4), np.float32))


def test_a_cancelled_future_does_not_crash_the_client(tmp_path):
    """cancel() succeeded on a pending future, and at its timeout the I/O loop crashed
    (InvalidStateError): every other future failed "client closed" and later ones never
    completed. A request sent is the server's to run: cancel() now says False."""
    with Client(_nobody(tmp_path)) as c:
        f = c.submit("m0", np.zeros((1, 4), np.float32), timeout=0.5)
        g = c.submit_generate("m0", np.zeros((1, 4), np.int64), max_new_tokens=2, timeout=0.5)
        other = c.submit("m0", np.zeros((1, 4), np.float32), timeout=1.0)
        assert f.cancel() is False and g.cancel() is False
        for future in (f, g, other):
            with pytest.raises(RequestTimeout):
                future.result(5)
        with pytest.raises(RequestTimeout):                # the loop still serves
            c.infer("m0", np.zeros((1, 4), np.float32), timeout=0.3)


def _session_blocks():
    """The serve command, the Python client and the shell lines of the documented session."""
    text = open(os.path.join(REPO, "docs", "control-plane.md")).read()
    at = text.find("<!-- example: serve-session -->")
    assert at >= 0, "the serving session is gone from docs/control-plane.md"
    blocks = re.findall(r"```(sh|python)\n(.*?)```", text[at:], re.S)[:3]
    assert [kind for kind, _ in blocks] == ["sh", "python", "sh"], blocks
    return [body for _, body in blocks]


def test_the_documented_session_runs_against_prefetchd_serve(tmp_path):
    serve, client, shell = _session_blocks()
    line = serve.strip()
    assert line.startswith("prefetchd serve ") and line.endswith(" &"), line
    bin_dir = os.path.dirname(sys.executable)            # where `prefetchd` is installed
    # ipc://serve.sock is <runtime dir>/serve.sock: a runtime dir of the test's own, short
    # (the workers' sockets beside it must fit an ipc path's 107 bytes).
    run = tempfile.mkdtemp(prefix="pfd-", dir="/tmp")
    env = dict(ENV, PATH=os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
               XDG_RUNTIME_DIR=str(run))
    # The block runs it in the background (`&`); here the test owns the process.
    proc = subprocess.Popen(shlex.split(line[:-1]), cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        from prefetchd.control import Client as ControlClient
        deadline = time.monotonic() + 120
        with ControlClient(f"ipc://{run}/prefetchd/serve.sock", timeout=1) as c:
            while True:
                assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
                assert time.monotonic() < deadline, "prefetchd serve did not become ready"
                try:
                    if c.ping()["workers"] == 1:
                        break
                except RequestTimeout:
                    pass
                time.sleep(0.2)
        (tmp_path / "client.py").write_text(client)
        out = subprocess.run([sys.executable, "client.py"], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().splitlines() == ["(2, 8, 256) True"], out.stdout
        out = subprocess.run(["bash", "-e", "-c", shell], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.splitlines() == ["out/output0.npy\tfloat32\t[2, 8, 256]", "True"], out.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(30) == 0, proc.stderr.read().decode()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
            shutil.rmtree(run, ignore_errors=True)
