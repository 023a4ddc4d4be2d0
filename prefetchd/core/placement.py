"""register(tier="host" | "remote"): placing a new tensor's values off the device.

The values go to a host block (one copy) or to the store (a write, then a read-back
that proves it durable and intact), and the register request resolves when they are
there; no device replica is made. A register(tier="device") is a load instead
(core/loads.py). These transfers carry their register request: the scheduler routes
their completions here, never to the write-back path of resident tensors. A FORGET
request undoes placements whose registration is abandoned (an offload() that failed
part-way): their host blocks and store files go, and so do their records.
Scheduler thread only, under the daemon's lock.
"""
import logging

from ..backend.base import TransferKind
from ..dtypes import store_meta
from ..errors import PrefetchdError, StorageError
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
        """Undo the placements of req.recs, registered and placed but never used: free
        their host blocks, remove their store files, forget their records. Refused, with
        nothing changed, for a record that is on the device, moving or held."""
        busy = next((r for r in req.recs if r.state is not State.ABSENT or r.pins or r.waiters), None)
        if busy is not None:
            self._outcomes.fail(req, PrefetchdError(
                f"cannot forget {busy.name!r}: it is {busy.state.value} with {busy.pins} pin(s)"))
            return
        for rec in req.recs:
            self._host.free(rec)
            if rec.remote_valid:
                rec.remote_valid = False
                try:
                    self._backend.store_remove(rec.name)
                except Exception as e:     # the file stays; the record goes all the same
                    log.warning("prefetchd: could not remove the store file of %r: %s", rec.name, e)
            self._registry.forget(rec)
        self._outcomes.resolve(req)
