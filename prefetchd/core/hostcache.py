"""Host RAM as a cache of the remote tier.

A tensor whose authoritative copy is on the remote tier may also keep a host
replica, filled when it is read from disk and used by later loads (a copy
from RAM instead of a disk read). Such a replica is clean by construction —
it equals the verified remote copy, and a write-back invalidates it — so it
is dropped for free when the host budget is needed. Host replicas that are a
tensor's only copy (`register(tier="host")`) are never dropped here.

Which replicas to keep is trace-driven: with a recorded execution order the
cache is Belady's (keep what is used again soonest; do not admit a tensor
whose next reuse is farther than everything it would displace), without one
it is LRU. Scheduler thread only.
"""
from . import lending


class HostCache:
    def __init__(self, backend, registry, policy, stats, budget):
        self.backend = backend
        self.registry = registry
        self.policy = policy
        self.stats = stats
        self.enabled = budget > 0

    @staticmethod
    def droppable(rec):
        """A host replica that is only a cache (the remote copy is the truth) and idle."""
        return rec.host_cached and rec.host_block is not None and not rec.reading_host

    def admit(self, rec):
        """Make room for a host replica of rec if the policy says it is worth it: True if
        rec should be filled into the host tier on its way to the device."""
        if not self.enabled or rec.nbytes == 0:
            return False
        return self._make_room(rec.nbytes, self.policy.reuse_distance(rec.name))

    def make_room(self, nbytes):
        """Drop cached replicas until nbytes fit (for data whose only copy is the host)."""
        return self._make_room(nbytes, None)

    def _make_room(self, nbytes, incoming_reuse):
        need = self.backend.block_bytes(nbytes)
        free = self.backend.host_capacity() - self.backend.host_used()
        if need <= free:
            return True
        victims = self._victims(incoming_reuse)
        if sum(self.backend.block_bytes(v.nbytes) for v in victims) + free < need:
            return False          # not worth (or not possible): bypass the cache
        for victim in victims:
            if free >= need:
                break
            free += self.backend.block_bytes(victim.nbytes)
            self.drop(victim)
        return True

    def _victims(self, incoming_reuse):
        """Droppable replicas, best victim first; with a trace, only those used again
        later than the incoming tensor would be."""
        candidates = [r for r in self.registry if self.droppable(r)]
        if incoming_reuse is None or incoming_reuse == float("inf"):
            return self.policy.rank(candidates)
        return self.policy.rank_beyond(candidates, incoming_reuse)

    def drop(self, rec):
        """Free rec's host replica. One lent to the device tier (core/lending.py) holds no
        bytes: its pages stay under the home and are freed with the device block; pages
        parked under the home are freed now."""
        lending.drop_parked(self.backend, self.stats, rec)
        self.backend.free_host(rec.host_block)
        rec.host_block = None
        rec.host_valid = False
        rec.host_lent = False
        self.stats.host_drops += 1
