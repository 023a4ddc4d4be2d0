"""Write-backs and drops: RESIDENT -> STORING -> RESIDENT(clean) -> ABSENT.

Invariant 3 (docs/design.md): a dirty replica is dropped only after its
write-back was read back and verified; a failed write-back leaves the replica
in place, dirty, and says so. Same two-halves shape as loads.py: `start`
issues one transfer, `*_done` applies its completion. Scheduler thread only,
under the daemon's lock; what it reaches is given to its constructor.
"""
from ..backend.base import TransferKind
from ..dtypes import store_meta
from ..errors import StorageError
from ..telemetry.timeline import NullTimeline
from .compute_writes import note_writes
from .records import State
from .transfers import transfer_error


class WriteBacks:
    def __init__(self, backend, memory, transfers, host_replicas, stats, *, emit, guard):
        self._backend = backend
        self._memory = memory
        self._transfers = transfers
        self._host = host_replicas
        self._stats = stats
        self._emit = emit              # fn(event, rec, seconds=0.0, error=None)
        self._guard = guard            # fn(rec): Python-level use of rec's tensor refuses
        self.timeline = NullTimeline()   # the scheduler's, when tracing is on

    # ------------------------------------------------------------------ eviction
    def evict(self, rec, reason):
        """Start dropping rec's device replica; write back first if it is the only copy."""
        self._note_writes(rec)
        if rec.dirty or not (rec.remote_valid or rec.host_valid):
            rec.evict_after_store = reason
            self.start(rec)
            return
        self.drop(rec, reason)

    def drop(self, rec, reason):
        assert rec.pins == 0 and rec.state is State.RESIDENT and not rec.dirty
        block, rec.block = rec.block, None
        rec.state = State.ABSENT
        rec.prefetched_unused = False
        self._memory.release(block, rec.exposed, rec.compute_epoch, rec)
        if rec.bound_address:
            self._guard(rec)   # the framework tensor still views the old block
        rec.exposed = False
        self._stats.evictions[reason] = self._stats.evictions.get(reason, 0) + 1
        self.timeline.eviction(rec.name, rec.nbytes, reason)
        self._emit("evicted", rec)

    def written_late(self, rec, block):
        """Compute wrote rec after its replica was dropped as clean, before the pages left
        its home (the drop waited for the compute fence): resident again, dirty, and
        written back before it goes, so the write is kept."""
        rec.block, rec.state = block, State.RESIDENT
        rec.exposed = False          # its compute has finished: the fence was reached
        rec.dirty = True
        rec.generation += 1
        self._stats.compute_writes += 1
        self.evict(rec, "watermark")

    # ------------------------------------------------------------------ write-back
    def start(self, rec):
        self._note_writes(rec)      # before the generation is taken: the snapshot includes it
        rec.state = State.STORING
        rec.store_generation = rec.generation
        tag = self._transfers.add(TransferKind.STORE, rec)
        try:
            self._backend.start_store(rec.name, rec.replica, rec.nbytes, store_meta(rec.shape, rec.dtype), tag)
        except Exception as e:   # e.g. no memory for the snapshot: stay resident, dirty, held
            self._transfers.discard(tag)
            self._held(rec, StorageError(f"cannot start writing back {rec.name!r}: {e}"))

    def store_done(self, rec, req, c, seconds):
        if c.status:
            self._held(rec, transfer_error(self._stats, "write", rec, c), seconds)
            return
        self._stats.record_transfer("store", rec.nbytes, seconds)
        tag = self._transfers.add(TransferKind.VERIFY, rec)
        try:
            self._backend.start_verify(rec.name, tag)
        except Exception as e:
            self._transfers.discard(tag)
            self._held(rec, StorageError(f"cannot verify the write-back of {rec.name!r}: {e}"))

    def verify_done(self, rec, req, c, seconds=0.0):
        if c.status:
            self._held(rec, transfer_error(self._stats, "verify", rec, c))
            return
        self._stats.writebacks += 1
        self._note_writes(rec)
        rec.remote_valid = True
        # A retry that landed (an evict's, not only a flush's): it is held for nothing now.
        rec.writeback_failed, rec.error = False, None
        if rec.host_valid and not rec.host_lent:   # the host replica, if any, is older now
            self._host.free(rec)
        # (A lent host block holds no bytes: the device replica's pages, just verified,
        # are what go back under it when the replica is dropped clean.)
        rec.state = State.RESIDENT
        rec.dirty = rec.generation != rec.store_generation   # written again while storing
        self._emit("written_back", rec)
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
        self._emit("failed", rec, seconds, str(error))

    def _note_writes(self, rec):
        note_writes(self._backend, self._stats, rec)
