"""The shared host tier's owner and client over real Unix sockets, in one process:
hostile requests, leases and the budget, eviction order, refusals, and a client
that refuses blocks it cannot trust."""
import json
import os
import socket
import threading

import numpy as np
import pytest

from prefetchd import _native
from prefetchd.errors import StorageError
from prefetchd.sharedhost import policy, wire
from prefetchd.sharedhost.blocks import segment_size
from prefetchd.sharedhost.client import Refused, SharedHostClient
from prefetchd.sharedhost.owner import SharedHostOwner
from helpers import wait_until
from procs import link_store, stage

N = 1 << 18                     # floats: 1 MiB tensors
TENSORS = {f"t{i}": [i, N] for i in range(4)}


def values(name):
    return np.random.default_rng(TENSORS[name][0]).standard_normal(N).astype(np.float32)


@pytest.fixture
def src(tmp_path):
    return stage(str(tmp_path), TENSORS)


def _owner(tmp_path, src, budget):
    return SharedHostOwner(str(tmp_path / "h.sock"), link_store(src, str(tmp_path / "own")), budget).start()


@pytest.fixture
def owner(tmp_path, src):
    o = _owner(tmp_path, src, 64 << 20)
    yield o
    o.close()


_IDENTS = {}


def _ident(src, name):
    """(name, version, nbytes, crc) of a tensor, read from a store of links to src."""
    if (src, name) not in _IDENTS:
        s = _native.FileStore(link_store(src, src + "-" + name))
        try:
            i = s.info(name)
            _IDENTS[src, name] = name, i["version"], i["nbytes"], i["crc"]
        finally:
            s.close()
    return _IDENTS[src, name]


def _read(grant):
    out = np.empty(grant.nbytes // 4, np.float32)
    grant.read_into(out)
    return out


def _raw(owner):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(owner.path)
    return s


def _ask(s, data):
    s.send(data)
    return json.loads(s.recv(wire.MAX_MESSAGE))


HOSTILE = [
    b"not json", b"\xff\xfe", b"[1, 2]", b"{}", b'{"op": "format_disk"}',
    b'{"op": "acquire"}', b'{"op": "acquire", "key": 7, "version": 1, "nbytes": 1, "crc": 1}',
    b'{"op": "acquire", "key": "", "version": 1, "nbytes": 1, "crc": 1}',
    json.dumps({"op": "acquire", "key": "k" * 5000, "version": 1, "nbytes": 1, "crc": 1}).encode(),
    b'{"op": "acquire", "key": "t0", "version": -1, "nbytes": 1, "crc": 1}',
    b'{"op": "acquire", "key": "t0", "version": 1, "nbytes": 1e30, "crc": 1}',
    b'{"op": "acquire", "key": "t0", "version": 1, "nbytes": true, "crc": 1}',
    b'{"op": "acquire", "key": "t0", "version": 1, "nbytes": 99999999999999999999, "crc": 1}',
    b'{"op": "acquire", "key": "t0", "version": 1, "nbytes": 4, "crc": 4294967296}',
    b'{"op": "trace", "names": "t0"}', b'{"op": "trace", "names": [1, 2]}',
    b'{"op": "hello", "pid": "me"}', b'{"op": "release", "key": null, "version": 1}',
    b'{"op": "acquire", "key": "\\ud800", "version": 1, "nbytes": 4, "crc": 1}',
    b"{" * 100000, b"[" * 100000,         # the second nests: json's RecursionError
    b'{"op": "acquire", "key": "t0", "key": "t1", "version": 1, "nbytes": 4, "crc": 1}',
    b'{"op": "acquire", "items": []}', b'{"op": "acquire", "items": "t0"}',
    b'{"op": "acquire", "items": [1]}', b'{"op": "release", "items": [{"key": "t0"}]}',
    json.dumps({"op": "acquire", "items": [{"key": "t0", "version": 1, "nbytes": 4, "crc": 1}] * 17}).encode(),
    json.dumps({"op": "acquire", "items": [{"key": "t0", "version": 1, "nbytes": 4, "crc": 1},
                                           {"key": 7, "version": 1, "nbytes": 4, "crc": 1}]}).encode(),
]


@pytest.mark.parametrize("data", HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_requests_get_a_reason_and_the_owner_keeps_serving(owner, data):
    s = _raw(owner)
    reply = _ask(s, data)
    assert reply["ok"] is False and reply["code"] == wire.BAD_REQUEST and reply["reason"]
    assert _ask(s, b'{"op": "status"}')["ok"] is True       # same connection still served
    s.close()
    assert owner.status()["leases"] == 0


def test_a_batch_gets_one_reply_per_item_naming_it_and_one_release_ends_its_leases(owner, src):
    s = _raw(owner)
    items = [dict(zip(("key", "version", "nbytes", "crc"), _ident(src, name))) for name in ("t0", "t1", "t0")]
    items += [{"key": "nope", "version": 1, "nbytes": 4, "crc": 0}, {**items[1], "crc": items[1]["crc"] ^ 1}]
    s.send(json.dumps({"op": "acquire", "items": items}).encode())
    replies = []
    for _ in items:
        data, fds, _, _ = socket.recv_fds(s, wire.MAX_MESSAGE, 1)
        replies.append((json.loads(data), fds))
    by_item = sorted(((r["key"], r["ok"], r.get("code"), len(fds)) for r, fds in replies))
    assert by_item == [("nope", False, wire.NOT_FOUND, 0), ("t0", True, None, 1), ("t0", True, None, 1),
                       ("t1", False, wire.MISMATCH, 0), ("t1", True, None, 1)]
    for reply, fds in replies:
        if reply["ok"]:
            got = np.frombuffer(os.pread(fds[0], reply["nbytes"], 0), np.float32)
            assert np.array_equal(got, values(reply["key"]))
            os.close(fds[0])
    assert owner.status()["leases"] == 3
    s.send(json.dumps({"op": "release", "items": [{"key": i["key"], "version": i["version"]}
                                                  for i in items[:3]]}).encode())
    assert _ask(s, b'{"op": "status"}')["status"]["leases"] == 0
    s.close()


def test_the_client_batch_answers_each_item_in_the_order_asked(owner, src):
    c = SharedHostClient(owner.path, "t")
    t0, t1 = _ident(src, "t0"), _ident(src, "t1")
    results = c.acquire_many([t1, ("nope", 1, 4, 0), t0, t1[:3] + (t1[3] ^ 1,)])
    assert [type(r).__name__ for r in results] == ["Grant", "Refused", "Grant", "Refused"]
    assert results[1].code == wire.NOT_FOUND and results[3].code == wire.MISMATCH
    assert np.array_equal(_read(results[0]), values("t1")) and np.array_equal(_read(results[2]), values("t0"))
    results[0].close(), results[2].close()
    assert wait_until(lambda: owner.status()["leases"] == 0, 5)
    c.close()


def test_oversized_messages_and_sent_descriptors_are_refused(owner):
    s = _raw(owner)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
    assert _ask(s, b" " * (wire.MAX_MESSAGE + 100))["code"] == wire.BAD_REQUEST
    r, w = os.pipe()
    socket.send_fds(s, [b'{"op": "status"}'], [r, w])     # descriptors the owner must not keep
    assert json.loads(s.recv(wire.MAX_MESSAGE))["ok"] is True
    os.close(r), os.close(w)
    s.close()


def test_refusals_name_what_differs(owner, src):
    c = SharedHostClient(owner.path, "t")
    name, version, nbytes, crc = _ident(src, "t0")
    for args, code in [((name, version, nbytes, crc ^ 1), wire.MISMATCH),
                       ((name, version + 1, nbytes, crc), wire.MISMATCH),
                       ((name, version, nbytes + 4, crc), wire.MISMATCH),
                       (("nope", 1, 4, 0), wire.NOT_FOUND)]:
        with pytest.raises(Refused) as e:
            c.acquire(*args)
        assert e.value.code == code
    c.close()


def test_a_lease_keeps_a_block_until_released_or_its_holder_disconnects(tmp_path, src):
    owner = _owner(tmp_path, src, segment_size(N * 4))      # room for one block
    try:
        a, b = SharedHostClient(owner.path, "a"), SharedHostClient(owner.path, "b")
        t0, t1 = _ident(src, "t0"), _ident(src, "t1")
        held = a.acquire(*t0)
        assert np.array_equal(_read(held), values("t0"))
        with pytest.raises(Refused) as e:
            b.acquire(*t1)                 # the only block is leased: never dropped
        assert e.value.code == wire.NO_ROOM
        assert owner.status()["leases"] == 1
        a.close()                          # the holder goes away: its lease with it
        held.close()
        # The owner sees the close on its own thread: b's next request may come first.
        assert wait_until(lambda: owner.status()["leases"] == 0, timeout=10)
        with b.acquire(*t1) as got:        # t0 is dropped for t1 now
            assert np.array_equal(_read(got), values("t1"))
        b.release(*t1[:2])                 # a stray release is ignored
        st = b.status()
        assert st["leases"] == 0 and st["counters"]["evictions"] == 1
        assert st["counters"]["stray_releases"] == 1
        assert st["counters"]["leases_released_on_close"] == 1
        b.close()
    finally:
        owner.close()


def test_belady_on_the_attached_traces_drops_the_block_used_last(tmp_path, src):
    owner = _owner(tmp_path, src, 2 * segment_size(N * 4))  # room for two blocks
    try:
        c = SharedHostClient(owner.path, "c")
        c.set_trace(["t0", "t1", "t2"])
        for name in ("t0", "t1", "t2"):      # t2 needs room: LRU would drop t0, the trace says
            ident = _ident(src, name)        # t0 is next (cyclic), so t1 goes
            c.acquire(*ident).close()
        st = c.status()
        assert st["counters"]["evictions"] == 1
        c.acquire(*_ident(src, "t0")).close()
        assert c.status()["counters"]["hits"] == 1      # t0 was kept
        c.close()
    finally:
        owner.close()


def test_trace_distances():
    t = policy.Trace(["a", "b", "c", "a"])
    assert t.distance("a") == 1 and t.distance("z") == policy.INF
    t.advance("a")
    assert (t.distance("b"), t.distance("c"), t.distance("a")) == (1, 2, 3)
    t.advance("b"), t.advance("c"), t.advance("a")
    assert t.distance("b") == 2        # wraps to the next pass
    blocks = [type("B", (), {"key": k, "last_use": i})() for i, k in enumerate("zbca")]
    assert [b.key for b in policy.rank(blocks, [t])] == ["z", "c", "b", "a"]


class _FakeOwner(threading.Thread):
    """An owner that grants whatever block `make_fd()` returns (to test the client)."""

    def __init__(self, path, make_fd, nbytes, crc):
        super().__init__(daemon=True)
        self.listen = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listen.bind(path)
        self.listen.listen(1)
        self.make_fd, self.nbytes, self.crc = make_fd, nbytes, crc
        self.start()

    def run(self):
        conn, _ = self.listen.accept()
        while data := conn.recv(wire.MAX_MESSAGE):
            msg = json.loads(data)
            if msg["op"] == "hello":
                conn.send(b'{"ok": true, "budget": 1}')
            elif msg["op"] == "acquire":
                fd = self.make_fd()
                item = msg["items"][0]
                socket.send_fds(conn, [json.dumps({"ok": True, "item": 0, "key": item["key"], "version": item["version"],
                                                   "nbytes": self.nbytes, "crc": self.crc,
                                                   "size": segment_size(self.nbytes)}).encode()], [fd])
                os.close(fd)


def _memfd(data, seal):
    import fcntl
    fd = os.memfd_create("fake", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, segment_size(len(data)))
    os.pwrite(fd, data, 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


@pytest.mark.parametrize("seal,garbage", [(False, False), (True, True)], ids=["unsealed", "wrong-bytes"])
def test_the_client_refuses_a_block_it_cannot_trust(tmp_path, seal, garbage):
    data = values("t0").tobytes()
    crc = _native.crc32c(data)
    served = bytes(len(data)) if garbage else data
    fake = _FakeOwner(str(tmp_path / "fake.sock"), lambda: _memfd(served, seal), len(data), crc)
    c = SharedHostClient(str(tmp_path / "fake.sock"), "c")
    with pytest.raises(Refused) as e:
        with c.acquire("t0", 1, len(data), crc) as grant:     # unsealed: refused here
            grant.read_into(np.empty(N, np.float32))        # wrong bytes: refused here
    assert e.value.code == "corrupt"
    assert ("sealed" in str(e.value)) if not seal else ("crc" in str(e.value))
    c.close()
    fake.join(5)


@pytest.mark.parametrize("covering", [False, True], ids=["dropped-mapping", "parked-mapping"])
def test_a_daemon_loads_a_written_weight_from_its_own_store_not_the_shared_tier(src, tmp_path, covering):
    # Without a covering budget the drop unmaps the block and the next load asks the owner,
    # which refuses the new version ("mismatch"): this daemon's store has it. With one, the
    # written pages (private copies of the mapping's) stay parked under the home.
    from prefetchd.daemon import Daemon
    owner = _owner(tmp_path, src, (64 << 20) if covering else (3 << 20) + (1 << 19))
    d = Daemon(store_dir=link_store(src, str(tmp_path / "w")), shared_host=owner.path,
               device_budget=4 << 20, host_budget=0).start()
    try:
        h = d.register_remote("t0", (N,), np.float32)
        with d.use([h]) as recs:
            view = np.frombuffer(recs[0].home, np.float32, N)
            assert np.array_equal(view, values("t0"))
            view[:] = 7.0                   # compute writes the weight in place
        d.evict([h]).result(30)             # written back to this daemon's store
        with d.use([h]) as recs:
            assert np.all(np.frombuffer(recs[0].home, np.float32, N) == 7.0)
        d.evict([h]).result(30)
        shared = d.status()["shared_host"]
        assert shared["hits"] == 1 and shared["refusals"] == ({} if covering else {"mismatch": 1})
        assert owner.status()["counters"]["fills"] == 1      # the dirty version never entered it
    finally:
        d.close(10)
    try:
        c = SharedHostClient(owner.path, "check")
        with c.acquire(*_ident(src, "t0")) as got:
            assert np.array_equal(_read(got), values("t0"))
        c.close()
    finally:
        owner.close()


def test_a_daemon_whose_shared_tier_is_not_running_refuses_to_start(tmp_path):
    from prefetchd.daemon import Daemon
    with pytest.raises(StorageError, match="cannot attach to the shared host tier"):
        Daemon(store_dir=str(tmp_path / "s"), shared_host=str(tmp_path / "none.sock"),
               device_budget=4 << 20).start()


def test_a_daemons_trace_reaches_the_owner(owner, src, tmp_path):
    # Belady on the union of the attached traces needs the daemons to send theirs.
    from prefetchd.daemon import Daemon
    d = Daemon(store_dir=link_store(src, str(tmp_path / "w")), shared_host=owner.path,
               device_budget=4 << 20, host_budget=0, name="traced").start()
    try:
        handles = [d.register_remote(name, (N,), np.float32) for name in TENSORS]
        assert [w["trace"] for w in owner.status()["workers"]] == [False]
        d.set_trace([[name] for name in TENSORS], owner="t")
        assert wait_until(lambda: [w["trace"] for w in owner.status()["workers"]] == [True], 10)
        with d.use(handles[:1]) as recs:
            assert np.array_equal(np.frombuffer(recs[0].home, np.float32, N), values("t0"))
    finally:
        d.close(10)


def test_the_owners_socket_goes_in_a_private_directory_and_never_over_a_live_owner(tmp_path, src):
    """docs/shared-host.md: "the socket is 0600 in a private directory". A missing directory
    killed the owner with a FileNotFoundError traceback, a world-writable one was taken, and a
    second owner unlinked a live owner's socket and bound its own: both said READY, the first
    ran on unreachable."""
    from prefetchd.errors import ConfigError
    path = str(tmp_path / "run" / "sub" / "h.sock")
    first = SharedHostOwner(path, link_store(src, str(tmp_path / "own")), 64 << 20).start()
    try:
        assert os.stat(tmp_path / "run" / "sub").st_mode & 0o777 == 0o700
        second_store = link_store(src, str(tmp_path / "own2"))
        with pytest.raises(ConfigError, match="another owner is listening there"):
            SharedHostOwner(path, second_store, 64 << 20).start()
        c = SharedHostClient(path)                      # the first still answers
        try:
            grant = c.acquire(*_ident(src, "t1"))
            np.testing.assert_array_equal(_read(grant), values("t1"))
            c.release("t1", grant.version)
        finally:
            c.close()
        _native.FileStore(second_store).close()         # the refused owner let its store go
    finally:
        first.close()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(ConfigError, match=r"is group- or world-writable \(mode 777\)"):
        SharedHostOwner(str(shared / "h.sock"), link_store(src, str(tmp_path / "own3")), 64 << 20).start()
    assert os.listdir(shared) == []


def test_a_file_at_the_socket_path_that_is_no_socket_is_refused_not_deleted(tmp_path, src):
    """A dead owner's socket is replaced; a user's file at the path was deleted the same way."""
    from prefetchd.errors import ConfigError
    private = tmp_path / "run"
    private.mkdir(mode=0o700)
    notes = private / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(ConfigError, match=f"{notes}: a file that is not a socket is there"):
        SharedHostOwner(str(notes), link_store(src, str(tmp_path / "own")), 64 << 20).start()
    assert notes.read_text() == "mine"


def test_an_owner_refuses_a_store_it_could_serve_nothing_from(tmp_path, src):
    """A mistyped --store was made (lock file and all) and the owner said READY serving
    nothing; on a sharded store's root its lock file made the next `stage --shard` fail."""
    from prefetchd.backend.base import SHARDS_FILE
    from prefetchd.errors import ConfigError
    from prefetchd.sharedhost import owner
    assert owner.SHARDS_FILE == SHARDS_FILE          # its own copy (backend imports sharedhost)
    sock = str(tmp_path / "run" / "h.sock")
    missing = tmp_path / "typo-store"
    with pytest.raises(ConfigError, match=f"{missing}: no such directory"):
        SharedHostOwner(sock, str(missing), 64 << 20)
    assert not missing.exists()
    root = tmp_path / "sharded"
    root.mkdir()
    (root / SHARDS_FILE).write_text("{}")
    with pytest.raises(ConfigError, match=f"{root}: a sharded store's root; .* {root}/rank_N"):
        SharedHostOwner(sock, str(root), 64 << 20)
    assert sorted(os.listdir(root)) == [SHARDS_FILE]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no tensors"):
        SharedHostOwner(sock, str(tmp_path / "empty"), 64 << 20)
    with pytest.raises(ConfigError, match="budget must be > 0"):
        SharedHostOwner(sock, link_store(src, str(tmp_path / "own")), 0)


def test_the_standalone_owner_says_why_it_cannot_start_in_one_line(tmp_path, src):
    import subprocess
    import sys
    from helpers import ENV, REPO
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    out = subprocess.run([sys.executable, "-m", "prefetchd.sharedhost", "--socket", str(shared / "h.sock"),
                          "--store", link_store(src, str(tmp_path / "own")), "--budget", "8MiB"],
                         capture_output=True, text=True, timeout=60, cwd=REPO, env=ENV)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith("python -m prefetchd.sharedhost: error: ") and "world-writable" in out.stderr


STUCK_READ = """
import os, sys, threading, time
sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]
from prefetchd import _native
from prefetchd.sharedhost.client import SharedHostClient
from prefetchd.sharedhost.owner import SharedHostOwner
from procs import link_store
src, root = sys.argv[1], sys.argv[3]
owner = SharedHostOwner(root + "/h.sock", link_store(src, root + "/own"), 64 << 20).start()
store = _native.FileStore(link_store(src, root + "/ident"))
info = store.info("t0")
store.close()
_native.inject_fault("read", "delay", nth=1, count=1, delay_ms=120000)     # a hung disk
client = SharedHostClient(owner.path, "c")
threading.Thread(target=lambda: client.acquire("t0", info["version"], info["nbytes"], info["crc"]),
                 daemon=True).start()
time.sleep(1.0)                    # the fill is in the read now
started = time.monotonic()
owner.close(timeout=1.0)
print(f"closed in {time.monotonic() - started:.1f}s", flush=True)
"""


def test_close_and_exit_are_bounded_while_a_fill_is_stuck_in_a_store_read(tmp_path, src):
    """A store read that does not return (a hung disk) held the owner's close() -- and a serve
    front's SIGTERM with it -- until it did: the fills ran on a ThreadPoolExecutor, shut down
    with wait=True and joined again at the interpreter's exit. In a child process: its exit too."""
    import subprocess
    import sys
    import time
    tests = os.path.dirname(os.path.abspath(__file__))
    started = time.monotonic()
    run = subprocess.run([sys.executable, "-c", STUCK_READ, src, tests, str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    closed = float(run.stdout.split()[-1].rstrip("s"))
    assert closed < 3.0, run.stdout
    assert "did not return within 1.0s of close" in run.stderr, run.stderr[-2000:]
    assert time.monotonic() - started < 50          # the process exited, the read still stuck


def test_connections_past_the_cap_are_refused_and_counted(tmp_path, src, monkeypatch):
    """A peer of our uid opening connections without end took every descriptor of the front."""
    from prefetchd.sharedhost import owner as owner_module
    monkeypatch.setattr(owner_module, "MAX_CONNECTIONS", 3)
    o = _owner(tmp_path, src, 64 << 20)
    try:
        kept = [SharedHostClient(o.path, f"c{i}") for i in range(3)]
        extra = _raw(o)
        assert wait_until(lambda: o.status()["counters"]["refused_over_cap"] == 1, timeout=10)
        assert extra.recv(16) == b""                      # closed by the owner
        extra.close()
        assert kept[0].status()["leases"] == 0            # the others are served
        for c in kept:
            c.close()
    finally:
        o.close()


OUT_OF_DESCRIPTORS = """
import os, resource, socket, sys, time
sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]
from prefetchd.sharedhost.owner import SharedHostOwner
from procs import link_store
src, root = sys.argv[1], sys.argv[3]
owner = SharedHostOwner(root + "/h.sock", link_store(src, root + "/own"), 64 << 20).start()
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 20, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
for _ in range(40):                 # the client ends use descriptors of this process too
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError:
        break
    try:
        s.connect(owner.path)
    except OSError:
        s.close()
        break
    held.append(s)
time.sleep(0.5)
cpu = time.process_time()
time.sleep(2.0)
print(f"cpu {time.process_time() - cpu:.2f}", flush=True)
"""


def test_running_out_of_descriptors_pauses_accepting_instead_of_spinning(tmp_path, src):
    """accept() failing with EMFILE left the listener readable: the owner's thread looped on
    it at 100% CPU and logged a traceback per try (131 MB of log in 10 s, an outside probe)."""
    import subprocess
    import sys
    tests = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", OUT_OF_DESCRIPTORS, src, tests, str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split()[-1]) < 0.5, (run.stdout, run.stderr[-1000:])
    assert 1 <= run.stderr.count("cannot accept a connection") <= 6, run.stderr[-2000:]
    assert len(run.stderr) < 20000


FOREIGN_OWNER = """
import os, socket, sys, time
path = sys.argv[1]
os.setgid(65534)
os.setuid(65534)                    # nobody: an owner of another uid at our socket's path
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(path)
os.chmod(path, 0o777)
s.listen()
print("listening", flush=True)
c, _ = s.accept()
time.sleep(5)
"""


def test_a_daemon_refuses_a_shared_tier_owned_by_another_uid(tmp_path):
    """Blocks are checked by their CRC32C only, which the acquire names: an owner of another
    uid at our socket's path (put there by a user who could rename its directory) handed a
    worker forged blocks, and the server answered wrong outputs (an outside probe)."""
    import subprocess
    import sys
    import tempfile
    if os.getuid() != 0:
        pytest.skip("needs root to run a peer as another uid")
    place = tempfile.mkdtemp(prefix="pfd-uid-")
    os.chmod(place, 0o777)
    path = os.path.join(place, "h.sock")
    peer = subprocess.Popen([sys.executable, "-c", FOREIGN_OWNER, path], stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout.readline().strip() == "listening"
        with pytest.raises(PermissionError, match="its owner runs as uid 65534"):
            SharedHostClient(path, "w")
    finally:
        peer.kill()
        peer.wait(10)
        import shutil
        shutil.rmtree(place, ignore_errors=True)


@pytest.mark.parametrize("owner_uid, mode", [(65534, 0o700), (0, 0o777)])
def test_a_runtime_directory_others_can_write_to_is_refused(tmp_path, monkeypatch, owner_uid, mode):
    """$XDG_RUNTIME_DIR kept across su (another user's) or open to others: they could rename
    our private prefetchd/ aside and put their sockets at its paths."""
    from prefetchd.control.endpoints import runtime_dir
    from prefetchd.errors import ConfigError
    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    base = tmp_path / "run"
    base.mkdir()
    os.chown(base, owner_uid, owner_uid)
    os.chmod(base, mode)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(base))
    with pytest.raises(ConfigError, match=r"\$XDG_RUNTIME_DIR is .*(owned by uid 65534|writable by others)"):
        runtime_dir()
    os.chmod(base, mode | 0o1000)                 # sticky, as /tmp: fine if it is ours
    if owner_uid == 0:
        assert runtime_dir() == str(base / "prefetchd")


OPEN_FILES = """
import os, resource, sys
sys.path[:0] = [sys.argv[2], os.path.dirname(sys.argv[2])]
from prefetchd.errors import ConfigError
from prefetchd.sharedhost.owner import SharedHostOwner
from procs import link_store
src, root, soft, hard = sys.argv[1], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
try:
    owner = SharedHostOwner(root + "/h.sock", link_store(src, root + "/own"), 64 << 20).start()
except ConfigError as e:
    print("refused:", e, flush=True)
else:
    print("started, soft limit", resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
    owner.close()
"""


@pytest.mark.parametrize("soft, hard", [(256, 256), (256, 4096)])
def test_an_owner_raises_its_open_file_limit_or_refuses_to_start(tmp_path, soft, hard):
    """Every block keeps two descriptors: past the limit every fill failed with EMFILE and the
    front stopped accepting its clients (an outside probe: 580 tensors, ulimit -n 1024)."""
    import subprocess
    import sys
    src = stage(str(tmp_path), {f"t{i}": [i, 16] for i in range(200)})
    tests = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run([sys.executable, "-c", OPEN_FILES, src, tests, str(tmp_path), str(soft), str(hard)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    if hard == 256:
        assert run.stdout.startswith("refused: the shared host tier may hold 200 blocks at once"), run.stdout
        assert "ulimit -n 528" in run.stdout, run.stdout
    else:
        assert run.stdout.strip() == "started, soft limit 528", run.stdout
