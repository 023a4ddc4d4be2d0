"""Real processes for the shared host tier tests: a staged store, an owner process
(`python -m prefetchd.sharedhost`) and daemon processes (_daemon_child.py)."""
import json
import os
import queue
import subprocess
import sys
import threading

import numpy as np

from helpers import ENV

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_daemon_child.py")
START_TIMEOUT = 60


def stage(root, tensors):
    """A FileStore at root/src holding tensors {name: (seed, count)} (float32, seeded)."""
    from prefetchd import _native
    src = os.path.join(root, "src")
    store = _native.FileStore(src)
    for name, (seed, count) in tensors.items():
        store.write_sync(name, np.random.default_rng(seed).standard_normal(count).astype(np.float32))
    store.close()
    return src


def link_store(src, dst):
    """A store of hard links to src's tensor files (what `prefetchd serve` workers get)."""
    os.mkdir(dst, 0o700)
    for entry in os.scandir(src):
        if entry.name.endswith(".pfd"):
            os.link(entry.path, os.path.join(dst, entry.name))
    return dst


def proc_numbers(pid):
    """(read_bytes from /proc/<pid>/io, Pss bytes from /proc/<pid>/smaps_rollup)."""
    with open(f"/proc/{pid}/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    with open(f"/proc/{pid}/smaps_rollup") as f:
        pss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    return int(io["read_bytes"]), pss


class Owner:
    def __init__(self, root, src, budget):
        self.socket = os.path.join(root, "host.sock")
        self.store = link_store(src, os.path.join(root, "owner-store"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefetchd.sharedhost", "--socket", self.socket, "--store", self.store,
             "--budget", str(budget), "--log-level", "WARNING"],
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), (line, self.proc.stderr.read() if self.proc.poll() is not None else "")

    def status(self):
        from prefetchd.sharedhost.client import SharedHostClient
        c = SharedHostClient(self.socket, "test", timeout=10)
        try:
            return c.status()
        finally:
            c.close()

    def stop(self):
        self.proc.terminate()
        try:
            out, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate(timeout=10)
        return self.proc.returncode, err


class Child:
    """One daemon process; `expect("ready")` / `expect("done")` read its JSON lines."""

    def __init__(self, store, socket, tensors, device_budget, rounds, host_budget=0):
        args = {"store": store, "socket": socket, "device_budget": device_budget, "host_budget": host_budget,
                "tensors": tensors, "rounds": rounds}
        self.proc = subprocess.Popen([sys.executable, CHILD, json.dumps(args)], env=ENV, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines = queue.SimpleQueue()
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stdout] + [self.lines.put("")],
                         daemon=True).start()

    def expect(self, what, timeout=START_TIMEOUT):
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"child sent no {what!r} line: {self.proc.stderr.read()[-3000:]}")
        msg = json.loads(line)
        assert what in msg, msg
        return msg[what]

    def finish(self, timeout=30):
        self.proc.stdin.close()
        self.proc.wait(timeout)
        err = self.proc.stderr.read()
        assert self.proc.returncode == 0, err[-3000:]
        return err
