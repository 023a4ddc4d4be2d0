"""The owner of the shared host tier: its socket, the attached processes, fills and replies.

One thread runs a selector over the listening socket, every attached process'
connection and a wake-up pipe; fills (one checksummed store read each) run on a
small thread pool and hand their result back through the pipe, so a slow disk
never stalls the replies to other processes.

The blocks, their leases and the budget are prefetchd.sharedhost.table (no I/O).

Leases. A process holds a lease on a block from its `acquire` (while the block
is filled, too) until its `release`, and the block is never dropped or reused
while any lease is held. A connection that closes — the process exited, was
killed, or broke the protocol — releases every lease it held: the kernel closes
the socket of a dead process, so no lease outlives its holder.

Trust. The socket is 0600 in a private directory and every peer's uid is
checked (SO_PEERCRED); still, each message is validated (prefetchd.sharedhost.wire)
and a bad one is answered with a reason, a connection that sends something
unreadable or stops reading its replies is closed. Nothing a peer sends can
crash the owner or make it hand out bytes the store did not verify.
"""
import collections
import logging
import os
import selectors
import socket
import threading
import time

from ..errors import ConfigError
from ..limits import raise_open_files
from ..socket_dirs import listener_at, peer_credentials, private_socket_dir, refuse_non_socket
from . import policy, wire
from .blocks import PAGE, SharedBlock, segment_size, shmem_huge_mode
from .fill_threads import FillThreads
from .table import BlockTable

log = logging.getLogger("prefetchd.sharedhost")

FILL_THREADS = 2
# Connections at once: a daemon holds one (a serve worker, a process sharing the tier); a peer
# of the same uid that opens them without end is refused past this, not given every descriptor.
MAX_CONNECTIONS = 1024
ACCEPT_PAUSE = 1.0          # seconds new connections wait after accept() ran out of descriptors
COUNTERS = ("hits", "fills", "fill_bytes", "fill_errors", "evictions", "attached", "detached",
            "acquire_requests", "release_requests", "stray_releases", "leases_released_on_close",
            "bad_requests", "refused_peers", "refused_over_cap")


class _Conn:
    def __init__(self, sock, ident, pid):
        self.sock, self.ident, self.pid = sock, ident, pid
        self.name = ""
        self.leases = collections.Counter()      # (key, version) -> leases held
        self.trace = None
        self.hits = self.fills = self.refused = 0


# backend.base.SHARDS_FILE: backend imports this package, so not from there (a test holds them equal).
SHARDS_FILE = "prefetchd-shards.json"


def _served_store(store_dir):
    """The FileStore at `store_dir`, opened; refused where no daemon could be served from it.
    A mistyped path was made (with a lock file in it) and the owner served nothing; a sharded
    root got a lock file that the next `stage --shard` refused as foreign content."""
    from .. import _native
    if not os.path.isdir(store_dir):
        raise ConfigError(f"shared host store {store_dir}: no such directory (serve a store "
                          f"`prefetchd stage CKPT --store DIR` made)")
    if os.path.exists(os.path.join(store_dir, SHARDS_FILE)):
        raise ConfigError(f"shared host store {store_dir}: a sharded store's root; an owner serves "
                          f"one rank's store, {store_dir}/rank_N")
    store = _native.FileStore(store_dir)
    if not store.keys():
        store.close()
        raise ConfigError(f"shared host store {store_dir}: holds no tensors")
    return store


def _listening_socket(path):
    """A SEQPACKET socket listening at `path`: its directory private (made 0700 if missing; a
    group- or world-writable one refused), a live owner's socket there refused (replacing it
    would leave that owner running unreachable), a dead one's replaced; bound 0600."""
    private_socket_dir(path, "e.g. a directory of its own, mode 0700")
    refuse_non_socket(path, "shared host socket")
    if listener_at(path, socket.SOCK_SEQPACKET):
        raise ConfigError(f"shared host socket {path}: another owner is listening there")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    sock.listen(64)
    sock.setblocking(False)
    return sock


def _check_open_files(store, budget):
    """A block holds two descriptors (its memfd, and the one Python's mmap keeps): raise the
    soft limit for the most the tier can hold at once, or refuse now. Past the limit every
    fill failed with EMFILE and the front stopped accepting its clients (an outside probe,
    580 tensors under `ulimit -n 1024`)."""
    blocks = min(len(store.keys()), budget // PAGE)
    need = 2 * blocks + 128                    # and the front's sockets, the store's files
    hard = raise_open_files(need)
    if hard is not None:
        store.close()
        raise ConfigError(f"the shared host tier may hold {blocks} blocks at once, two open files each, "
                          f"and this process's open-file limit is {hard}: raise it (ulimit -n {need}, "
                          f"LimitNOFILE= in a systemd unit) or give a smaller host budget")


def _status_of(owner):
    """SharedHostOwner.status(), its lock held."""
    return {
        "socket": owner.path, "budget": owner.budget, "covering": owner.covering, **owner._blocks.summary(),
        "shmem_huge_pages": owner._huge_mode,
        "counters": dict(owner.counters),
        "workers": [{"pid": c.pid, "name": c.name, "leases": sum(c.leases.values()),
                     "hits": c.hits, "fills": c.fills, "refused": c.refused,
                     "trace": c.trace is not None} for c in owner._conns.values()],
    }


class SharedHostOwner:
    """`SharedHostOwner(socket_path, store_dir, budget).start()`; `close()` stops it.

    store_dir: a FileStore directory holding the tensors the attached daemons serve
    (e.g. hard links to a `prefetchd stage` store); the owner opens it itself.
    """

    def __init__(self, socket_path, store_dir, budget, *, fill_threads=FILL_THREADS):
        if budget <= 0:
            raise ConfigError(f"shared host budget must be > 0, got {budget}")
        self.path, self.budget = socket_path, budget
        self._huge_mode = shmem_huge_mode()      # blocks >= 2 MiB ask for huge pages
        self.store = _served_store(store_dir)
        # Every counter from the start (a monitoring script read counters["hits"]: KeyError
        # until the first hit); refused_<code> ones appear with their first refusal.
        self.counters = collections.Counter(dict.fromkeys(COUNTERS, 0))
        self._blocks = BlockTable(budget, self.counters)
        # Every block of the store fits at once: no block is ever dropped for room, so a
        # daemon may keep a lease for as long as it keeps the pages mapped under a home
        # whose tensor is not resident (parked: docs/shared-host.md, "Parked mappings").
        self.covering = sum(segment_size(self.store.info(k)["nbytes"]) for k in self.store.keys()) <= budget
        _check_open_files(self.store, budget)
        self._conns = {}            # fd -> _Conn
        self._lock = threading.Lock()
        self._ids = 0
        self._done = collections.deque()   # (entry, error) from fill threads
        self._fills = FillThreads(fill_threads, "prefetchd-shared-fill")
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = False
        self._accept_paused = 0.0   # when to listen again after running out of descriptors
        self._thread = None
        self._listen = None

    # -- lifecycle
    def start(self):
        """Listen (_listening_socket) and serve; ConfigError if the socket path is refused."""
        try:
            self._listen = _listening_socket(self.path)
        except BaseException:
            self.store.close()           # (its lock: the store is free for another owner)
            self._wake_r.close()
            self._wake_w.close()
            raise
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="prefetchd-shared-host", daemon=True)
        self._thread.start()
        log.info("shared host tier on %s: budget %d B, store %s", self.path, self.budget,
                 self.store.directory)
        return self

    def close(self, timeout=10.0):
        """Stop within `timeout`. A store read that does not return by then (a hung disk)
        cannot be cancelled: its block and the store stay open for the process's exit (memfd
        segments: nothing outlives it), rather than close() waiting for the read for good."""
        if self._thread is None:
            return
        deadline = time.monotonic() + timeout
        self._stop = True
        self._wake_w.send(b"x")
        self._thread.join(timeout)
        self._fills.shutdown()
        stuck = self._fills.wait(max(0.0, deadline - time.monotonic()))
        if stuck:
            log.error("shared host tier: %d store read(s) did not return within %.1fs of close; their "
                      "blocks and the store are left open to the process's exit", stuck, timeout)
        with self._lock:
            for conn in list(self._conns.values()):
                self._drop_conn(conn, "owner closing")
            if not stuck:
                self._blocks.close()
        for closable in [self._sel, self._listen, self._wake_r, self._wake_w] + ([] if stuck else [self.store]):
            closable.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._thread = None

    # -- introspection
    def status(self):
        """Bytes, blocks, hits and the leases each attached process holds."""
        with self._lock:
            return _status_of(self)

    # -- the loop
    def _run(self):
        while not self._stop:
            events = self._sel.select(1.0)
            if self._accept_paused and time.monotonic() >= self._accept_paused:
                self._accept_paused = 0.0
                self._sel.register(self._listen, selectors.EVENT_READ, "listen")
            with self._lock:
                for key, _ in events:
                    try:
                        self._on_event(key)
                    except Exception:        # a bug here must not take the tier down
                        log.exception("shared host tier: handling an event failed")
                        if isinstance(key.data, _Conn):
                            self._drop_conn(key.data, "internal error")

    def _on_event(self, key):
        if key.data == "listen":
            self._accept()
        elif key.data == "wake":
            self._wake_r.recv(4096)
            while self._done:
                self._filled(*self._done.popleft())
        else:
            self._on_message(key.data)

    def _accept(self):
        try:
            sock, _ = self._listen.accept()
        except BlockingIOError:
            return
        except OSError as e:
            # Out of descriptors (EMFILE): the listener stays readable, and accepting in a loop
            # spun a core and logged a traceback per try. Pause accepting for a second.
            log.warning("shared host tier: cannot accept a connection (%s); pausing new ones for %gs",
                        e.strerror, ACCEPT_PAUSE)
            self._sel.unregister(self._listen)
            self._accept_paused = time.monotonic() + ACCEPT_PAUSE
            return
        if len(self._conns) >= MAX_CONNECTIONS:     # a peer of ours opening them without end
            self.counters["refused_over_cap"] += 1
            sock.close()
            return
        pid, uid, _gid = peer_credentials(sock)
        if uid != os.getuid():
            log.warning("shared host tier: refused a peer of uid %d (pid %d)", uid, pid)
            self.counters["refused_peers"] += 1
            sock.close()
            return
        sock.setblocking(False)
        self._ids += 1
        conn = _Conn(sock, self._ids, pid)
        self._conns[sock.fileno()] = conn
        self._sel.register(sock, selectors.EVENT_READ, conn)
        self.counters["attached"] += 1

    def _drop_conn(self, conn, why):
        """Close a connection and release every lease it held."""
        if self._conns.pop(conn.sock.fileno(), None) is None:
            return
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        released = self._blocks.release_all(conn)
        conn.sock.close()
        self.counters["detached"] += 1
        if released:
            self.counters["leases_released_on_close"] += released
            log.info("shared host tier: pid %d detached (%s); released %d leases", conn.pid, why, released)

    def _on_message(self, conn):
        try:
            data, fds, flags, _ = socket.recv_fds(conn.sock, wire.MAX_MESSAGE + 1, 4)
        except BlockingIOError:
            return
        except OSError as e:
            self._drop_conn(conn, f"socket error {e}")
            return
        for fd in fds:           # a peer has no reason to send descriptors: never keep one
            os.close(fd)
        if not data:
            self._drop_conn(conn, "closed")
            return
        if flags & socket.MSG_TRUNC or len(data) > wire.MAX_MESSAGE:
            self._refuse(conn, wire.BAD_REQUEST, f"message exceeds {wire.MAX_MESSAGE} bytes")
            return
        try:
            op, args = wire.check_request(wire.decode(data))
        except wire.WireError as e:
            self.counters["bad_requests"] += 1
            self._refuse(conn, wire.BAD_REQUEST, str(e))
            return
        getattr(self, "_op_" + op)(conn, **args)

    def _reply(self, conn, obj, fd=None):
        try:
            wire.send(conn.sock, obj, fd)
        except (BlockingIOError, OSError) as e:   # not reading its replies, or gone
            self._drop_conn(conn, f"cannot reply: {e}")

    def _refuse(self, conn, code, reason, item=None):
        """Refuse a request, or one item of an acquire: item = (index, key, version)."""
        self.counters["refused_" + code] += 1
        conn.refused += 1
        named = {} if item is None else dict(zip(("item", "key", "version"), item))
        self._reply(conn, {"ok": False, **named, "code": code, "reason": reason})

    # -- ops
    def _op_hello(self, conn, pid, name):
        conn.name = name
        self._reply(conn, {"ok": True, "budget": self.budget, "covering": self.covering})

    def _op_status(self, conn):
        self._reply(conn, {"ok": True, "status": _status_of(self)})

    def _op_trace(self, conn, names):
        conn.trace = policy.Trace(names) if names else None
        self._reply(conn, {"ok": True, "names": len(names)})

    def _op_release(self, conn, items):
        self.counters["release_requests"] += 1
        for item in items:
            if not self._blocks.unlease(conn, (item["key"], item["version"])):
                self.counters["stray_releases"] += 1    # not held: ignored (release has no reply)

    def _op_acquire(self, conn, items):
        self.counters["acquire_requests"] += 1     # of hits + fills + refusals items
        for index, item in enumerate(items):
            if conn.sock.fileno() not in self._conns:
                return                                  # dropped while replying
            self._acquire(conn, index, **item)

    def _acquire(self, conn, index, key, version, nbytes, crc):
        """One item of an acquire; its reply names it (index, key, version)."""
        ident, named = (key, version), (index, key, version)
        if conn.trace is not None:
            conn.trace.advance(key)
        entry = self._blocks.get(ident)
        if entry is None:
            try:
                info = self.store.info(key)
            except KeyError:
                self._refuse(conn, wire.NOT_FOUND, f"the shared tier's store has no tensor {key!r}", named)
                return
            if (info["version"], info["nbytes"], info["crc"]) != (version, nbytes, crc):
                self._refuse(conn, wire.MISMATCH, (
                    f"{key!r}: the shared tier's store holds version {info['version']} ({info['nbytes']} "
                    f"bytes, crc {info['crc']:#x}), not version {version} ({nbytes} bytes, crc {crc:#x})"), named)
                return
            traces = [c.trace for c in self._conns.values() if c.trace is not None]
            if not self._blocks.make_room(segment_size(nbytes), traces):
                self._refuse(conn, wire.NO_ROOM, f"every block of the shared tier's {self.budget} B is "
                                                 f"leased; {key!r} needs {segment_size(nbytes)} B", named)
                return
            try:
                entry = self._blocks.add(ident, SharedBlock(key, version, nbytes, crc))
            except OSError as e:
                self._refuse(conn, wire.NO_ROOM, f"cannot create a shared segment: {e.strerror}", named)
                return
            self.counters["fills"] += 1
            conn.fills += 1
            self._fills.submit(self._fill, entry)
        elif entry.block.crc != crc or entry.block.nbytes != nbytes:
            self._refuse(conn, wire.MISMATCH, f"{key!r} version {version}: the shared block holds "
                                              f"{entry.block.nbytes} bytes with crc {entry.block.crc:#x}", named)
            return
        else:
            self.counters["hits"] += 1
            conn.hits += 1
        self._blocks.lease(conn, ident, entry)
        if entry.ready:
            self._grant(conn, index, entry)
        else:
            entry.waiters.append((conn, index))

    def _grant(self, conn, index, entry):
        b = entry.block
        self._reply(conn, {"ok": True, "item": index, "key": b.key, "version": b.version,
                           "nbytes": b.nbytes, "crc": b.crc, "size": b.size}, b.fd)

    # -- fills
    def _fill(self, entry):
        error = None
        try:
            entry.block.fill(self.store)
        except Exception as e:      # ChecksumMismatch, IOFailure, NotFound, a changed store
            error = e
        self._done.append((entry, error))
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass                    # closing

    def _filled(self, entry, error):
        ident = (entry.block.key, entry.block.version)
        waiters, entry.waiters = entry.waiters, []
        if error is None:
            entry.ready = True
            self.counters["fill_bytes"] += entry.block.nbytes
            for conn, index in waiters:
                if conn.sock.fileno() in self._conns:
                    self._grant(conn, index, entry)
            return
        log.warning("shared host tier: filling %r failed; the block is not shared: %s", entry.key, error)
        self._blocks.discard(ident)
        self.counters["fill_errors"] += 1
        for conn, index in waiters:
            self._blocks.unlease(conn, ident)
            if conn.sock.fileno() in self._conns:
                self._refuse(conn, wire.IO_ERROR, f"reading {entry.key!r} into the shared tier failed: {error}",
                             (index, *ident))
