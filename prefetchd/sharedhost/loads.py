"""The cpu backend's loads through the shared host tier.

`SharedLoads` is the seam the cpu backend calls for every load from the
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
import queue
import threading
from typing import NamedTuple

from . import wire
from .client import Refused, SharedHostClient

log = logging.getLogger("prefetchd.sharedhost")


class _Load(NamedTuple):
    """A load waiting on SharedLoads' queue: the remote->block load start_load was given."""
    key: str
    block: object
    nbytes: int
    tag: int
    verify: bool


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
        self._parked = {}              # home address -> Grant: leases held while a parked home maps it
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
        self._jobs.put(_Load(key, block, nbytes, tag, verify))
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

    # Parked mappings (docs/shared-host.md, "Parked mappings"): where the owner's budget
    # holds every block of the store at once (`client.covering`), no block is ever
    # dropped for room, so a dropped replica may leave the segment mapped under its home,
    # PROT_NONE, and its next load unprotects it: no request, no mapping, no page move.
    # The lease follows the pages: from the block to the home and back.
    def parks(self, block):
        """Whether the drop of `block`'s replica may park its mapping under the home."""
        with self._mapped_lock:
            return self.client.covering and not self.client.closed and block.address in self._mapped

    def parked(self, block, home):
        """`block`'s mapping is parked under `home` (the block is freed next): its lease stays."""
        with self._mapped_lock:
            grant = self._mapped.pop(block.address, None)
            if grant is not None:
                self._parked[home.address] = grant

    def unparked(self, home, block):
        """The mapping parked under `home` is resident again, `block` its slot."""
        with self._mapped_lock:
            grant = self._parked.pop(home.address, None)
            if grant is not None:
                self._mapped[block.address] = grant

    def dropped(self, home):
        """The mapping parked under `home` is gone: end its lease (queued, like unmapped)."""
        with self._mapped_lock:
            grant = self._parked.pop(home.address, None)
        if grant is not None:
            self._jobs.put(_Release(grant))

    def describe(self):
        with self._mapped_lock:
            leases, parked = len(self._mapped) + len(self._parked), len(self._parked)
        return {"socket": self.client.path, "attached": not self.client.closed, **self.counts,
                "covering": self.client.covering, "mapped_leases": leases, "parked_leases": parked,
                "refusals": dict(self.refusals)}

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
        loads = [job for job in batch if isinstance(job, _Load)]
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
        """Ask the owner for the blocks of `loads` [_Load] in one request; each load
        completes from its grant or from this daemon's store."""
        asked, wants = [], []
        for load in loads:
            try:
                info = self.backend.store.info(load.key)
            except Exception:            # not in this store, or it failed: its own read reports why
                self._safely(self._own_read, load)
                continue
            asked.append(load)
            wants.append((load.key, info["version"], info["nbytes"], info["crc"]))
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
            log.exception("shared host tier: load of %r failed", load.key)

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
