"""A daemon's side of the shared host tier: attach to the owner, and load through it.

`SharedHostClient` speaks prefetchd.sharedhost.wire to the owner, one request at a
time. `SharedLoads` is the seam the cpu backend calls for every load from the
remote tier (`start_load`): on its own thread it asks the owner for the block of
(tensor name, version, crc) this daemon's store holds, copies the block into the
device block, releases the lease, and completes the load on the backend's load
stream. Whatever goes wrong — the owner refuses (another version: a weight this
daemon wrote back; no room; the owner's read failed), the block is not sealed or
its bytes do not match the checksum, the owner is gone — the load falls back to
this daemon's own checksummed store read, as without the shared tier. So the
shared tier can save reads and RAM but never changes what a load returns.

Map or copy (docs/shared-host.md, "Copy or map"). A load into a device block of the
cpu backend maps the segment over the block (`Block.map_segment`: private,
read-only, no copy; the block then moves to the home and back like any other, and a
write by compute gets a private page), and the lease is held until that block is
freed (`unmapped`): the block's range maps the segment until then. Any other
destination (a host block, a backend or kernel that cannot move file mappings,
`shared_host_map = false`) gets a copy, a pread from the memfd, and the lease ends
with the copy.
"""
import logging
import os
import queue
import socket
import threading

from . import wire
from .blocks import check_received

log = logging.getLogger("prefetchd.sharedhost")


class Refused(Exception):
    """The owner will not share this tensor (code: a wire refusal code, or "corrupt")."""

    def __init__(self, code, reason):
        super().__init__(f"{code}: {reason}")
        self.code = code


class SharedHostClient:
    """One connection to the owner. Thread-safe (requests are serialised)."""

    def __init__(self, path, name="", timeout=60.0):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.settimeout(timeout)
        try:
            self.sock.connect(path)
        except OSError:
            self.sock.close()
            raise
        self._lock = threading.Lock()
        self._verified = set()     # (key, version, memfd inode): checksummed once per block
        self.closed = False
        self.budget = self._call({"op": "hello", "pid": os.getpid(), "name": name[:128]})[0]["budget"]

    def _call(self, obj, expect_reply=True):
        with self._lock:
            if self.closed:
                raise ConnectionError(f"shared host tier {self.path}: connection closed")
            try:
                wire.send(self.sock, obj)
                if not expect_reply:
                    return None, None
                data, fds, _, _ = socket.recv_fds(self.sock, wire.MAX_MESSAGE, 1)
                if not data:
                    raise ConnectionError("the owner closed the connection")
                return wire.decode(data), (fds[0] if fds else None)
            except (OSError, wire.WireError) as e:
                # Out of step with the owner (timeout, death, garbage): closing the
                # socket releases every lease this process holds there.
                self._close_locked()
                raise ConnectionError(f"shared host tier {self.path}: {e}") from None

    def acquire(self, key, version, nbytes, crc):
        """A Grant of the sealed block holding these bytes (a lease: `release` it);
        Refused if the owner will not share them or the block fails its checks."""
        reply, fd = self._call({"op": "acquire", "key": key, "version": version, "nbytes": nbytes,
                                "crc": crc})
        if not reply.get("ok"):
            if fd is not None:
                os.close(fd)
            raise Refused(reply.get("code", "?"), reply.get("reason", ""))
        try:
            if fd is None:
                raise ValueError("the owner granted a block without its descriptor")
            if (reply.get("nbytes"), reply.get("crc")) != (nbytes, crc):
                raise ValueError(f"the owner granted {reply.get('nbytes')} bytes crc {reply.get('crc')}")
            inode = check_received(fd, nbytes, reply.get("size"))
        except ValueError as e:
            if fd is not None:
                os.close(fd)
            self.release(key, version)
            raise Refused("corrupt", str(e)) from None
        return Grant(self, key, version, nbytes, crc, fd, (key, version, inode) in self._verified, inode)

    def release(self, key, version):
        try:
            self._call({"op": "release", "key": key, "version": version}, expect_reply=False)
        except ConnectionError:
            pass                    # closed: the owner released everything already

    def set_trace(self, names):
        return self._call({"op": "trace", "names": list(names)})[0]

    def status(self):
        return self._call({"op": "status"})[0]["status"]

    def close(self):
        with self._lock:
            self._close_locked()

    def _close_locked(self):
        if not self.closed:
            self.closed = True
            self.sock.close()


class Grant:
    """One leased block: `read_into` copies it out, `map_into` maps it over a device
    block (either checked against the store's crc the first time this process reads
    this block); `close` releases the lease of a copy, `release` that of a mapping."""

    def __init__(self, client, key, version, nbytes, crc, fd, verified, inode):
        self.client, self.key, self.version, self.nbytes, self.crc = client, key, version, nbytes, crc
        self.fd, self._verified, self._inode = fd, verified, inode

    def map_into(self, block):
        """Map the block's bytes over the device `block` (no copy), checked against the
        store's crc the first time; the descriptor is closed, the lease stays held (the
        caller releases it with `release` once the block is freed). Refused ("corrupt")
        on a mismatch; NativeError if the mapping fails."""
        from .. import _native
        block.map_segment(self.fd, self.nbytes)
        if not self._verified:
            with memoryview(block) as view:
                got = _native.crc32c(view[:self.nbytes])
            if got != self.crc:
                raise Refused("corrupt", f"shared block of {self.key!r} has crc {got:#x}, its "
                                         f"store copy {self.crc:#x}")
            self.client._verified.add((self.key, self.version, self._inode))
            self._verified = True
        os.close(self.fd)
        self.fd = -1

    def release(self):
        """End the lease of a mapped grant (its descriptor is closed already)."""
        self.client.release(self.key, self.version)

    def read_into(self, dst):
        """Copy the block's bytes to the front of the writable buffer dst. A pread, not a
        mapping (docs/shared-host.md, "Copy or map"). Refused
        ("corrupt") if the bytes do not match the crc of this daemon's store copy."""
        from .. import _native
        with memoryview(dst) as view, view.cast("B")[:self.nbytes] as out:
            done = 0
            while done < self.nbytes:
                got = os.preadv(self.fd, [out[done:]], done)
                if got <= 0:
                    raise Refused("corrupt", f"shared block of {self.key!r} ended at {done} bytes")
                done += got
            if not self._verified:
                got = _native.crc32c(out)
                if got != self.crc:
                    raise Refused("corrupt", f"shared block of {self.key!r} has crc {got:#x}, its "
                                             f"store copy {self.crc:#x}")
                self.client._verified.add((self.key, self.version, self._inode))
                self._verified = True

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            self.client.release(self.key, self.version)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Trace:
    """A trace waiting on SharedLoads' queue."""

    def __init__(self, names):
        self.names = names


class SharedLoads:
    """The cpu backend's loads through the shared tier (see the module docstring)."""

    def __init__(self, client, backend, maps=None):
        self.client, self.backend = client, backend
        # maps(block): whether a load into `block` maps the segment instead of copying
        self._maps = maps or (lambda block: False)
        self._mapped = {}              # block address -> Grant: leases held while a block maps its segment
        self._mapped_lock = threading.Lock()
        self.counts = {"hits": 0, "hit_bytes": 0, "mapped": 0, "fallbacks": 0, "fallback_bytes": 0}
        self.refusals = {}
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="prefetchd-shared-loads", daemon=True)
        self._thread.start()

    def start_load(self, key, block, nbytes, tag, verify):
        """Queue a remote->block load through the shared tier; False if it is not attached."""
        if self.client.closed:
            return False
        self._jobs.put((key, block, nbytes, tag, verify))
        return True

    def set_trace(self, steps):
        """This daemon's recorded load order (one collection of tensor names per step),
        queued for the owner: it ranks its blocks by Belady's rule on the union of the
        attached processes' traces (prefetchd.sharedhost.policy). Sent from the load
        thread, so the caller never waits on the owner."""
        self._jobs.put(_Trace([name for step in steps for name in step]))

    def unmapped(self, block):
        """`block` (released) maps no segment any more: end the lease its load kept."""
        with self._mapped_lock:
            grant = self._mapped.pop(block.address, None)
        if grant is not None:
            grant.release()

    def describe(self):
        with self._mapped_lock:
            leases = len(self._mapped)
        return {"socket": self.client.path, "attached": not self.client.closed, **self.counts,
                "mapped_leases": leases, "refusals": dict(self.refusals)}

    def close(self, timeout=10.0):
        self._jobs.put(None)
        self._thread.join(timeout)
        self.client.close()

    def _run(self):
        while (job := self._jobs.get()) is not None:
            if isinstance(job, _Trace):
                self._send_trace(job.names)
                continue
            try:
                self._load(*job)
            except Exception:        # e.g. the stream closed under a closing daemon
                log.exception("shared host tier: load of %r failed", job[0])

    def _send_trace(self, names):
        if self.client.closed:
            return
        try:
            self.client.set_trace(names)
        except Exception as e:       # the owner keeps ranking by LRU for this process
            log.warning("shared host tier: sending the trace (%d names) failed: %s", len(names), e)

    def _load(self, key, block, nbytes, tag, verify):
        be = self.backend
        try:
            info = be.store.info(key)
            version = info["version"]
            grant = self.client.acquire(key, version, info["nbytes"], info["crc"])
        except Refused as e:
            self.refusals[e.code] = self.refusals.get(e.code, 0) + 1
            if e.code != wire.MISMATCH:
                log.info("shared host tier: reading %r from this daemon's store: %s", key, e)
            return self._own_read(key, block, nbytes, tag, verify)
        except (KeyError, ConnectionError) as e:
            if isinstance(e, ConnectionError):
                log.warning("shared host tier detached; loads read this daemon's store: %s", e)
            return self._own_read(key, block, nbytes, tag, verify)
        try:
            if nbytes and self._maps(block):
                self._map(grant, block)
            else:
                with grant:
                    grant.read_into(block)
        except Exception as e:       # never leave a load without a completion
            if isinstance(e, Refused):
                self.refusals[e.code] = self.refusals.get(e.code, 0) + 1
            log.warning("shared host tier: loading %r from its shared block failed (%s); "
                        "reading this daemon's store", key, e)
            return self._own_read(key, block, nbytes, tag, verify)
        self.counts["hits"] += 1
        self.counts["hit_bytes"] += nbytes
        be.load_stream.record(tag=tag, cq=be.cq)

    def _map(self, grant, block):
        """Map the grant over `block`, keeping its lease until `unmapped(block)`."""
        try:
            grant.map_into(block)
        except BaseException:
            grant.close()            # the block may map part of it: released with the block
            raise
        with self._mapped_lock:
            stale = self._mapped.pop(block.address, None)
            self._mapped[block.address] = grant
        if stale is not None:        # a block freed without `unmapped` (a bug): do not leak its lease
            stale.release()
        self.counts["mapped"] += 1

    def _own_read(self, key, block, nbytes, tag, verify):
        self.counts["fallbacks"] += 1
        self.counts["fallback_bytes"] += nbytes
        be = self.backend
        be.load_stream.read(be.store, key, block, verify=verify, tag=tag, cq=be.cq)


def attach(path, backend, name="", maps=None):
    """SharedLoads for `backend` attached to the owner at `path` (maps: see SharedLoads);
    OSError if it cannot connect."""
    return SharedLoads(SharedHostClient(path, name), backend, maps)
