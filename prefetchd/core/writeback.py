"""Write-backs and drops: RESIDENT -> STORING -> RESIDENT(clean) -> ABSENT.

Invariant 3 (docs/design.md): a dirty replica is dropped only after its
write-back was read back and verified; a failed write-back leaves the replica
in place, dirty, and says so. Same two-halves shape as loads.py: `start_*`
issues one transfer, `*_done` applies its completion.
"""
from ..backend.base import TransferKind
from ..errors import StorageError
from .records import State


class WriteBacks:
    def __init__(self, s):
        self.s = s

    # ------------------------------------------------------------------ eviction
    def evict(self, rec, reason):
        """Start dropping rec's device replica; write back first if it is the only copy."""
        self.s.note_writes(rec)
        if rec.dirty or not (rec.remote_valid or rec.host_valid):
            rec.evict_after_store = reason
            self.start(rec)
            return
        self.drop(rec, reason)

    def drop(self, rec, reason):
        s = self.s
        assert rec.pins == 0 and rec.state is State.RESIDENT and not rec.dirty
        block, rec.block = rec.block, None
        rec.state = State.ABSENT
        rec.prefetched_unused = False
        s.memory.release(block, rec.exposed, rec.compute_epoch, rec)
        if rec.bound_address:
            s.guard(rec)   # the framework tensor still views the old block
        rec.exposed = False
        s.stats.evictions[reason] = s.stats.evictions.get(reason, 0) + 1
        s.timeline.eviction(rec.name, rec.nbytes, reason)
        s.emit("evicted", rec)

    def written_late(self, rec, block):
        """Compute wrote rec after its replica was dropped as clean, before the pages left
        its home (the drop waited for the compute fence): resident again, dirty, and
        written back before it goes, so the write is kept."""
        s = self.s
        rec.block, rec.state = block, State.RESIDENT
        rec.exposed = False          # its compute has finished: the fence was reached
        rec.dirty = True
        rec.generation += 1
        s.stats.compute_writes += 1
        self.evict(rec, "watermark")

    # ------------------------------------------------------------------ write-back
    def start(self, rec):
        s = self.s
        s.note_writes(rec)      # before the generation is taken: the snapshot includes it
        rec.state = State.STORING
        rec.store_generation = rec.generation
        tag = s.transfers.add(TransferKind.STORE, rec)
        try:
            s.backend.start_store(rec.name, rec.replica, rec.nbytes, b"", tag)
        except Exception as e:   # e.g. no memory for the snapshot: stay resident, dirty, held
            s.transfers.discard(tag)
            self._held(rec, StorageError(f"cannot start writing back {rec.name!r}: {e}"))

    def store_done(self, rec, req, c, seconds):
        s = self.s
        if c.status:
            error = s.transfer_error("write", rec, c)
            if req is not None:   # initial store of a register(tier="remote")
                rec.error = error
                s.outcomes.resolve(req, error)
                return
            self._held(rec, error, seconds)
            return
        s.stats.record_transfer("store", rec.nbytes, seconds)
        tag = s.transfers.add(TransferKind.VERIFY, rec, req)
        try:
            s.backend.start_verify(rec.name, tag)
        except Exception as e:
            s.transfers.discard(tag)
            error = StorageError(f"cannot verify the write-back of {rec.name!r}: {e}")
            if req is not None:
                s.outcomes.resolve(req, error)
            else:
                self._held(rec, error)

    def verify_done(self, rec, req, c):
        s = self.s
        if req is not None:       # register(tier="remote")
            rec.initial = None
            if c.status:
                s.outcomes.resolve(req, s.transfer_error("verify", rec, c))
            else:
                rec.remote_valid = True
                s.outcomes.resolve(req)
            return
        if c.status:
            self._held(rec, s.transfer_error("verify", rec, c))
            return
        s.stats.writebacks += 1
        s.note_writes(rec)
        rec.remote_valid = True
        if rec.host_valid and not rec.host_lent:   # the host replica, if any, is older now
            s.loads.free_host(rec)
        # (A lent host block holds no bytes: the device replica's pages, just verified,
        # are what go back under it when the replica is dropped clean.)
        rec.state = State.RESIDENT
        rec.dirty = rec.generation != rec.store_generation   # written again while storing
        s.emit("written_back", rec)
        reason, rec.evict_after_store = rec.evict_after_store, None
        if reason and not rec.pins:
            if rec.dirty:
                self.evict(rec, reason)
            else:
                self.drop(rec, reason)

    def _held(self, rec, error, seconds=0.0):
        """The write-back failed: the device replica stays, dirty and in place; nothing is lost."""
        rec.error = error
        rec.state = State.RESIDENT
        rec.writeback_failed = True
        rec.evict_after_store = None
        self.s.emit("failed", rec, seconds, str(error))

    # ------------------------------------------------------------------ register(tier=host|remote)
    def initial_store(self, req):
        """Place register()'s values on the host or remote tier (no device replica)."""
        s = self.s
        rec = req.recs[0]
        array, tier = req.args
        rec.initial = array
        if tier == "host":
            if not s.loads.alloc_host(rec, req):
                return
            kind, issue = TransferKind.D2H, lambda tag: s.backend.start_copy(
                TransferKind.D2H, rec.host_block, array, rec.nbytes, tag)
        else:
            kind, issue = TransferKind.STORE, lambda tag: s.backend.start_store(
                rec.name, array, rec.nbytes, b"", tag, snapshot=False)
        tag = s.transfers.add(kind, rec, req)
        try:
            issue(tag)
        except Exception as e:
            s.transfers.discard(tag)
            s.loads.free_host(rec)
            s.outcomes.resolve(req, StorageError(f"cannot place {rec.name!r} on the {tier} tier: {e}"))

    def host_copy_done(self, rec, req, c, seconds):
        s = self.s
        rec.initial = None
        if c.status:
            s.loads.free_host(rec)
            s.outcomes.resolve(req, StorageError(f"staging {rec.name!r} in the host tier: {c.message}"))
            return
        rec.host_valid = True
        s.stats.record_transfer("d2h", rec.nbytes, seconds)
        s.outcomes.resolve(req)
