"""Host replicas: giving a tensor a copy in host RAM, and taking it away.

`stage` (Daemon.stage_to_host) reads tensors from the remote tier into host blocks
for weights-in-RAM setups; `alloc`/`free` give and take a host block for the loads
that go through the host cache and for register(tier="host"). The host budget is
exact: a block that cannot be had fails its request, saying why.
Scheduler thread only, under the daemon's lock.
"""
from ..backend.base import TransferKind
from ..errors import BudgetError, StorageError
from . import lending
from .transfers import transfer_error


class HostReplicas:
    def __init__(self, config, backend, hostcache, transfers, outcomes, stats):
        self._config = config
        self._backend = backend
        self._hostcache = hostcache
        self._transfers = transfers
        self._outcomes = outcomes
        self._stats = stats

    # ------------------------------------------------------------------ stage requests
    def stage(self, req):
        """Give req's tensors a host replica read from the remote tier."""
        todo = [r for r in req.recs if not r.host_valid]
        for rec in todo:
            if not rec.remote_valid:
                self._outcomes.fail(req, StorageError(
                    f"cannot stage {rec.name!r} to the host tier: it has no remote replica"))
                return
        req.remaining = len(todo)
        if not todo:
            self._outcomes.resolve(req)
        for rec in todo:
            if not self.alloc(rec, req):
                return
            tag = self._transfers.add(TransferKind.STAGE, rec, req)
            try:
                self._backend.start_load(rec.name, rec.host_block, rec.nbytes, tag,
                                         self._config.verify_reads)
            except Exception as e:
                self._transfers.discard(tag)
                self.free(rec)
                self._outcomes.fail(req, StorageError(f"cannot stage {rec.name!r}: {e}"))
                return

    def staged(self, rec, req, c):
        """One read of a stage request landed in rec's host block."""
        if c.status:
            self.free(rec)
            self._outcomes.fail(req, transfer_error(self._stats, "read", rec, c))
            return
        rec.host_valid = True
        req.remaining -= 1
        if req.remaining == 0:
            self._outcomes.resolve(req)

    # ------------------------------------------------------------------ blocks
    def try_alloc(self, rec):
        """A host block for rec if one can be had now (the host cache made room): True if so."""
        try:
            rec.host_block = self._backend.alloc_host(rec.nbytes)
            return True
        except Exception:          # room was made, but e.g. the pool's mapping failed
            return False

    def alloc(self, rec, req):
        """Give rec a host block, dropping cached replicas if needed, or fail req saying
        why (the host budget is exact)."""
        self._hostcache.make_room(rec.nbytes)
        try:
            rec.host_block = self._backend.alloc_host(rec.nbytes)
            return True
        except Exception as e:
            self._outcomes.fail(req, BudgetError(
                f"cannot stage {rec.name!r} ({rec.nbytes} bytes) in the host tier: {e}"))
            return False

    def free(self, rec):
        lending.drop_parked(self._backend, self._stats, rec)
        if rec.host_block is not None:
            self._backend.free_host(rec.host_block)
        rec.host_block = None
        rec.host_valid = False
        rec.host_lent = False      # lent pages, if any, are freed with the device block
