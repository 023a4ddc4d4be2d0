"""register(tier="host" | "remote"): placing a new tensor's values off the device.

The values go to a host block (one copy) or to the store (a write, then a read-back
that proves it durable and intact), and the register request resolves when they are
there; no device replica is made. A register(tier="device") is a load instead
(core/loads.py). These transfers carry their register request: the scheduler routes
their completions here, never to the write-back path of resident tensors. A FORGET
request undoes placements whose registration is abandoned (an offload() that failed
part-way), or unregisters evicted tensors (Daemon.unregister): their host blocks and
the store files this daemon wrote go, and so do their records.
Scheduler thread only, under the daemon's lock.
"""
import logging

from ..backend.base import TransferKind
from ..dtypes import store_meta
from ..errors import PrefetchdError, StorageError
from . import lending
from .records import State
from .transfers import transfer_error

log = logging.getLogger("prefetchd")


class Placements:
    def __init__(self, backend, registry, transfers, outcomes, host_replicas, stats):
        self._backend = backend
        self._registry = registry
        self._transfers = transfers
        self._outcomes = outcomes
        self._host = host_replicas
        self._stats = stats

    def start(self, req):
        rec = req.recs[0]
        array, tier = req.args
        rec.initial = array
        if tier == "host":
            if not self._host.alloc(rec, req):
                return
            kind, issue = TransferKind.D2H, lambda tag: self._backend.start_copy(
                TransferKind.D2H, rec.host_block, array, rec.nbytes, tag)
        else:
            kind, issue = TransferKind.STORE, lambda tag: self._backend.start_store(
                rec.name, array, rec.nbytes, store_meta(rec.shape, rec.dtype), tag, snapshot=False)
        tag = self._transfers.add(kind, rec, req)
        try:
            issue(tag)
        except Exception as e:
            self._transfers.discard(tag)
            self._host.free(rec)
            self._outcomes.resolve(req, StorageError(f"cannot place {rec.name!r} on the {tier} tier: {e}"))

    # ------------------------------------------------------------------ completions
    def stored(self, rec, req, c, seconds):
        """The write to the store landed: read it back before the register resolves."""
        if c.status:
            rec.error = transfer_error(self._stats, "write", rec, c)
            self._outcomes.resolve(req, rec.error)
            return
        self._stats.record_transfer("store", rec.nbytes, seconds)
        tag = self._transfers.add(TransferKind.VERIFY, rec, req)
        try:
            self._backend.start_verify(rec.name, tag)
        except Exception as e:
            self._transfers.discard(tag)
            self._outcomes.resolve(req, StorageError(f"cannot verify the write-back of {rec.name!r}: {e}"))

    def verified(self, rec, req, c, seconds=0.0):
        rec.initial = None
        if c.status:
            self._outcomes.resolve(req, transfer_error(self._stats, "verify", rec, c))
            return
        rec.remote_valid = True
        self._outcomes.resolve(req)

    def copied(self, rec, req, c, seconds):
        """The values landed in the host block: the host replica is the tensor's copy."""
        rec.initial = None
        if c.status:
            self._host.free(rec)
            self._outcomes.resolve(req, StorageError(f"staging {rec.name!r} in the host tier: {c.message}"))
            return
        rec.host_valid = True
        self._stats.record_transfer("d2h", rec.nbytes, seconds)
        self._outcomes.resolve(req)

    # ------------------------------------------------------------------ abandoned
    def forget(self, req):
        """Forget req.recs, none of them on the device: fail the prefetches waiting for
        them, free their host blocks (and the host pages or shared-tier mapping parked
        under their homes), remove the store files this daemon wrote, drop their records.
        Refused, with nothing changed, while one is on the device, moving, pinned or waited
        for by compute. Their homes stay reserved and unmapped: their framework tensors
        point there for good, so a stray read faults, never reads another tensor's bytes."""
        for rec in req.recs:
            why = self._busy(rec)
            if why:
                self._outcomes.fail(req, PrefetchdError(f"cannot forget {rec.name!r}: {why}"))
                return
        for rec in req.recs:
            self._outcomes.fail_waiters(rec, unregistered())
            lending.drop_parked(self._backend, self._stats, rec, mappings=True)
            self._host.free(rec)
            if rec.remote_valid and not rec.keeps_store_file:
                try:
                    self._backend.store_remove(rec.name)
                except Exception as e:     # the file stays; the record goes all the same
                    log.warning("prefetchd: could not remove the store file of %r: %s", rec.name, e)
            rec.remote_valid = False       # a request still holding the record finds no replica
            self._registry.forget(rec)
        self._outcomes.resolve(req)

    def _busy(self, rec):
        """Why rec cannot be forgotten now, or None."""
        if self._registry.records.get(rec.name) is not rec:
            return "it is not registered (any more)"
        if rec.state is not State.ABSENT or rec.pins:
            return f"it is {rec.state.value} with {rec.pins} pin(s)"
        if any(w.demand for w in rec.waiters):
            return "compute is waiting for it"
        return None


def unregistered():
    """The error of a prefetch whose tensor is forgotten before its load ran."""
    return PrefetchdError("prefetchd: the tensor was unregistered before this prefetch ran")
