"""Evict, unregister and flush requests: started when they arrive, settled as their
write-backs land.

An evict drops each tensor's device replica (writing a dirty one back first) and resolves
once every one is gone; an unregister does the same, first failing the prefetches waiting
for the tensors (a queued load would bring one back), then forgets them (core/placement.py)
where an evict resolves. A flush writes dirty replicas back and resolves once every write
has landed, failing with a FlushError naming each one that did not. An evict or unregister
of a pinned tensor is refused; a tensor loading or being written back is waited for.
Scheduler thread only, under the daemon's lock.
"""
from ..errors import FlushError, PinnedError
from .placement import unregistered
from .records import State
from .requests import Kind


class ExplicitRequests:
    def __init__(self, registry, memory, writebacks, outcomes, note_writes, forget):
        self._registry = registry
        self._memory = memory
        self._writebacks = writebacks
        self._outcomes = outcomes
        self._note_writes = note_writes      # fn(rec): dirty it if compute wrote it in place
        self._forget = forget                # fn(request): core/placement.py's forget
        self.waiting = []                    # requests waiting on transfers: (request, recs)

    def unregister(self, req):
        busy = next((r for r in req.recs if r.pins or any(w.demand for w in r.waiters)), None)
        if busy is not None:
            self._outcomes.fail(req, PinnedError(
                f"cannot unregister {busy.name!r}: compute holds it ({busy.pins} pin(s)) or waits for it"),
                "refused")
            return
        for rec in req.recs:
            self._outcomes.fail_waiters(rec, unregistered())
        self.evict(req)

    def evict(self, req):
        for rec in req.recs:
            if rec.pins:
                self._outcomes.fail(req, PinnedError(
                    f"cannot evict {rec.name!r}: it is pinned ({rec.pins} pin(s): a running unit, a daemon.use "
                    f"block or a control-plane lease); unpin it first"), "refused")
                return
        pending = []
        for rec in req.recs:
            if rec.state is State.RESIDENT:
                self._writebacks.evict(rec, "explicit")
            if rec.state is not State.ABSENT:
                if rec.state is State.LOADING:
                    rec.evict_after_load = True
                pending.append(rec)
        if pending:
            self.waiting.append((req, pending))
        else:
            self._evicted(req)

    def _evicted(self, req):
        self._memory.fence_if(lambda: True)   # an explicit evict gives the memory back now
        if req.kind is Kind.UNREGISTER:
            self._forget(req)
        else:
            self._outcomes.resolve(req)

    def flush(self, req):
        recs = req.recs if req.recs is not None else tuple(self._registry)
        pending = []
        for rec in recs:
            self._note_writes(rec)
            if rec.state is State.RESIDENT and (rec.dirty or not (rec.remote_valid or rec.host_valid)):
                rec.writeback_failed = False
                self._writebacks.start(rec)
            if rec.state is State.STORING:
                pending.append(rec)
        # Those that failed already (at start, or before and not retried) are reported with
        # the pending ones once every one of those has settled.
        req.args = [r for r in recs if _failed(r)]
        if pending:
            self.waiting.append((req, pending))
            return
        self._outcomes.resolve(req, _flush_error(req.args))

    def settle(self):
        still = []
        for req, recs in self.waiting:
            if req.kind is Kind.FLUSH:
                if any(r.state is State.STORING for r in recs):
                    still.append((req, recs))
                else:
                    self._outcomes.resolve(req, _flush_error([*req.args, *filter(_failed, recs)]))
                continue
            failed = next((r for r in recs if _failed(r)), None)
            if failed is not None:
                self._outcomes.resolve(req, failed.error)
                continue
            for r in recs:                          # an evict or unregister request
                if r.state is State.RESIDENT and not r.pins:
                    self._writebacks.evict(r, "explicit")
            if all(r.state is State.ABSENT for r in recs):
                self._evicted(req)
            else:
                still.append((req, recs))
        self.waiting = still

    def cancel_all(self, error):
        for req, _ in self.waiting:
            self._outcomes.resolve(req, error)
        self.waiting.clear()


def _failed(rec):
    """Its last write-back failed: the replica stays, dirty (writeback.py's _held)."""
    return rec.writeback_failed and rec.state is State.RESIDENT


def _flush_error(failed):
    """A flush's outcome: None, or a FlushError naming every tensor whose write-back failed."""
    failures = {r.name: r.error for r in failed}
    return FlushError(failures) if failures else None
