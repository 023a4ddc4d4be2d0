"""Small helpers shared by test modules (import as `from helpers import ...`)."""
import os
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The environment of a child process that must import this checkout's prefetchd.
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))


def start_serve(endpoint, args, env, workers=1, timeout=120):
    """A real `prefetchd serve` process on `endpoint` with `args`, once `workers` workers
    answer a ping (AssertionError with its stderr if it exits first)."""
    import subprocess
    import sys
    from prefetchd.control import Client, RequestTimeout
    proc = subprocess.Popen([sys.executable, "-m", "prefetchd.cli", "serve", "--endpoint", endpoint,
                             "--workers", str(workers), *args], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    with Client(endpoint, timeout=1) as c:
        def up():
            try:
                return c.ping()["workers"] == workers
            except RequestTimeout:
                return proc.poll() is not None
        assert wait_until(up, timeout, 0.2) and proc.poll() is None, proc.stderr.read()
    return proc


def stop_serve(proc, timeout=30):
    """SIGTERM, then SIGKILL if it has not exited within `timeout`; its exit code."""
    import signal
    import subprocess
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)


def children_of(pid):
    """Pids of the live processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return found


def wait_until(predicate, timeout=5.0, interval=0.02):
    """Poll `predicate` until it is true or `timeout` seconds pass; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


class FakeMarker:
    """A compute-fence word (the daemon's compute marker) raised by the test: `reach(epoch)`."""

    def __init__(self):
        self.word = 0
        self.cond = threading.Condition()

    def reach(self, epoch):
        with self.cond:
            self.word = epoch
            self.cond.notify_all()

    def wait(self, epoch, timeout):
        with self.cond:
            self.cond.wait_for(lambda: self.word >= epoch, timeout)
            return self.word


def ping_within(endpoint, within):
    """Whether a new control client got a ping answered at `endpoint` within `within`
    seconds, retrying each second as a client would (a request sent on a connection a
    server's guard then drops is lost)."""
    from prefetchd.control import Client, RequestTimeout
    deadline = time.monotonic() + within
    with Client(endpoint, timeout=1.0) as c:
        while time.monotonic() < deadline:
            try:
                return c.ping()["pong"]
            except RequestTimeout:
                pass
    return False


def running(pid):
    """Whether `pid` runs (a zombie does not: a container's init may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
