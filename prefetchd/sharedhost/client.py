"""A daemon's side of the shared host tier: attach to the owner, and load through it.

`SharedHostClient` speaks prefetchd.sharedhost.wire to the owner, one request at a
time. `SharedLoads` is the seam the cpu backend calls for every load from the
remote tier (`start_load`): on its own thread it takes every load queued by then
(a unit's tensors, at most wire.MAX_BATCH) and asks the owner in one request for
the blocks of (tensor name, version, crc) this daemon's store holds, maps or
copies each block into its device block, and completes each load on the
backend's load stream. Leases ended meanwhile go to the owner in one release
message ahead of that request: one wake-up of the owner per batch, not two per
tensor. Whatever goes wrong — the owner refuses (another version: a weight this
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


def _close_fds(fds):
    for fd in fds:
        if fd is not None:
            os.close(fd)


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
        self.budget = self._call({"op": "hello", "pid": os.getpid(), "name": name[:128]})[0][0]["budget"]

    def _call(self, obj, replies=1):
        """Send one request and receive up to `replies` messages: [(reply, fd or None)].
        A refusal naming no item refuses the whole request and is its last reply."""
        with self._lock:
            if self.closed:
                raise ConnectionError(f"shared host tier {self.path}: connection closed")
            got, fd = [], None
            try:
                wire.send(self.sock, obj)
                while len(got) < replies:
                    data, fds, _, _ = socket.recv_fds(self.sock, wire.MAX_MESSAGE, 1)
                    fd = fds[0] if fds else None
                    if not data:
                        raise ConnectionError("the owner closed the connection")
                    got.append((wire.decode(data), fd))
                    fd = None
                    if not got[-1][0].get("ok") and "item" not in got[-1][0]:
                        break
                return got
            except (OSError, wire.WireError) as e:
                # Out of step with the owner (timeout, death, garbage): closing the
                # socket releases every lease this process holds there.
                _close_fds([fd] + [f for _, f in got])
                self._close_locked()
                raise ConnectionError(f"shared host tier {self.path}: {e}") from None

    def acquire(self, key, version, nbytes, crc):
        """A Grant of the sealed block holding these bytes (a lease: `release` it);
        Refused if the owner will not share them or the block fails its checks."""
        result = self.acquire_many([(key, version, nbytes, crc)])[0]
        if isinstance(result, Refused):
            raise result
        return result

    def acquire_many(self, wants):
        """One request for the blocks of `wants`, [(key, version, nbytes, crc)] (at most
        wire.MAX_BATCH): a Grant or a Refused for each, in the order asked.
        ConnectionError (the connection closed: no lease held) if the owner's replies do
        not answer exactly these items."""
        items = [{"key": k, "version": v, "nbytes": n, "crc": c} for k, v, n, c in wants]
        replies = self._call({"op": "acquire", "items": items}, len(items))
        answers = [None] * len(wants)
        for reply, fd in replies:
            index = reply.get("item")
            if (type(index) is not int or not 0 <= index < len(wants) or answers[index] is not None
                    or (reply.get("key"), reply.get("version")) != wants[index][:2]):
                _close_fds(f for _, f in replies)    # e.g. a bad_request naming no item
                self.close()
                raise ConnectionError(f"shared host tier {self.path}: a reply to no item asked: "
                                      f"{reply.get('code')}: {reply.get('reason')}")
            answers[index] = (reply, fd)
        return [self._granted(want, *answer) for want, answer in zip(wants, answers)]

    def _granted(self, want, reply, fd):
        """The Grant a reply makes of `want`, or the Refused it is."""
        key, version, nbytes, crc = want
        if not reply.get("ok"):
            if fd is not None:
                os.close(fd)
            return Refused(reply.get("code", "?"), reply.get("reason", ""))
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
            return Refused("corrupt", str(e))
        return Grant(self, key, version, nbytes, crc, fd, (key, version, inode) in self._verified, inode)

    def release(self, key, version):
        self.release_many([(key, version)])

    def release_many(self, idents):
        """End the leases of [(key, version)] (no reply; batches of wire.MAX_BATCH)."""
        idents = list(idents)
        for at in range(0, len(idents), wire.MAX_BATCH):
            items = [{"key": k, "version": v} for k, v in idents[at:at + wire.MAX_BATCH]]
            try:
                self._call({"op": "release", "items": items}, replies=0)
            except ConnectionError:
                return              # closed: the owner released everything already

    def set_trace(self, names):
        return self._call({"op": "trace", "names": list(names)})[0][0]

    def status(self):
        return self._call({"op": "status"})[0][0]["status"]

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


class _Release:
    """The lease of a freed mapped block, waiting on SharedLoads' queue."""

    def __init__(self, grant):
        self.ident = (grant.key, grant.version)


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
        """`block` (released) maps no segment any more: end the lease its load kept
        (queued: sent from the load thread with the next batch, so the caller never
        waits on the owner)."""
        with self._mapped_lock:
            grant = self._mapped.pop(block.address, None)
        if grant is not None:
            self._jobs.put(_Release(grant))

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
            batch = [job]
            while len(batch) < wire.MAX_BATCH:      # what else is queued now: one message for it
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._serve(batch)
                    return
                batch.append(job)
            self._serve(batch)

    def _serve(self, batch):
        try:
            self._serve_batch(batch)
        except Exception:            # a bug here must not stop every later load
            log.exception("shared host tier: serving a batch of %d jobs failed", len(batch))

    def _serve_batch(self, batch):
        """Releases first (they make room), then traces, then one acquire for the loads."""
        releases = [job.ident for job in batch if isinstance(job, _Release)]
        if releases:
            self.client.release_many(releases)
        for job in batch:
            if isinstance(job, _Trace):
                self._send_trace(job.names)
        loads = [job for job in batch if isinstance(job, tuple)]
        if loads:
            self._load_many(loads)

    def _send_trace(self, names):
        if self.client.closed:
            return
        try:
            self.client.set_trace(names)
        except Exception as e:       # the owner keeps ranking by LRU for this process
            log.warning("shared host tier: sending the trace (%d names) failed: %s", len(names), e)

    def _load_many(self, loads):
        """Ask the owner for the blocks of `loads` [(key, block, nbytes, tag, verify)] in
        one request; each load completes from its grant or from this daemon's store."""
        asked, wants = [], []
        for load in loads:
            try:
                info = self.backend.store.info(load[0])
            except Exception:            # not in this store, or it failed: its own read reports why
                self._safely(self._own_read, load)
                continue
            asked.append(load)
            wants.append((load[0], info["version"], info["nbytes"], info["crc"]))
        if not asked:
            return
        try:
            results = self.client.acquire_many(wants)
        except ConnectionError as e:
            log.warning("shared host tier detached; loads read this daemon's store: %s", e)
            for load in asked:
                self._safely(self._own_read, load)
            return
        for load, result in zip(asked, results):
            self._safely(self._finish, load, result)

    def _safely(self, step, load, *args):
        """step(*load, *args), logged if it fails: one load's failure never stops the batch."""
        try:
            step(*load, *args)
        except Exception:            # e.g. the stream closed under a closing daemon
            log.exception("shared host tier: load of %r failed", load[0])

    def _finish(self, key, block, nbytes, tag, verify, grant):
        """Complete one load from its grant (a Refused: from this daemon's store)."""
        try:
            if isinstance(grant, Refused):
                raise grant
            if nbytes and self._maps(block):
                self._map(grant, block)
            else:
                with grant:
                    grant.read_into(block)
        except Refused as e:         # another version (a weight written back), no room, corrupt
            self.refusals[e.code] = self.refusals.get(e.code, 0) + 1
            if e.code != wire.MISMATCH:
                log.info("shared host tier: reading %r from this daemon's store: %s", key, e)
            return self._own_read(key, block, nbytes, tag, verify)
        except Exception as e:       # never leave a load without a completion
            log.warning("shared host tier: loading %r from its shared block failed (%s); "
                        "reading this daemon's store", key, e)
            return self._own_read(key, block, nbytes, tag, verify)
        self.counts["hits"] += 1
        self.counts["hit_bytes"] += nbytes
        be = self.backend
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
