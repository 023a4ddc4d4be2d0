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
it is LRU. Where the traced tensors are each used once per pass and do not all
fit, the cache keeps steps spread evenly along the trace instead (core/spread.py):
the same hits, and the disk reads between them overlap compute. Scheduler
thread only.
"""
from . import lending
from .spread import spread


class HostCache:
    def __init__(self, backend, registry, policy, stats, budget):
        self.backend = backend
        self.registry = registry
        self.policy = policy
        self.stats = stats
        self.enabled = budget > 0
        self._spread_for = None   # (policy.traces_set, capacity) the spread below was made for
        self._spread = None       # (traced names, kept names), or None: Belady/LRU alone

    def admit(self, rec):
        """Make room for a host replica of rec if the policy says it is worth it: True if
        rec should be filled into the host tier on its way to the device."""
        if not self.enabled or rec.nbytes == 0:
            return False
        reuse = self.policy.reuse_distance(rec.name)
        chosen = self.spread()
        if chosen is None or rec.name not in chosen[0]:
            return self._make_room(rec.nbytes, reuse)
        kept = chosen[1]
        return rec.name in kept and self._make_room(rec.nbytes, reuse, kept)

    def spread(self):
        """(traced names, names kept) when the cache spreads its replicas over single-use
        traces it cannot hold whole (core/spread.py), else None."""
        capacity = self.backend.host_capacity() - sum(
            self.backend.block_bytes(r.nbytes) for r in self.registry.host_only)   # host-only data stays
        key = (self.policy.traces_set, capacity)
        if key != self._spread_for:
            self._spread_for, self._spread = key, self._spread_over(capacity)
        return self._spread

    def _spread_over(self, capacity):
        sizes = {r.name: self.backend.block_bytes(r.nbytes) for r in self.registry if r.remote_valid}
        steps, seen = [], set()
        for names in self.policy.single_use_steps():
            step = [n for n in names if n in sizes and n not in seen]
            seen.update(step)
            steps.append(step)
        if sum(sizes[n] for n in seen) <= capacity:
            return None              # every traced tensor fits: nothing to choose
        kept = spread([sum(sizes[n] for n in step) for step in steps], capacity)
        return frozenset(seen), frozenset(n for i in kept for n in steps[i])

    def make_room(self, nbytes):
        """Drop cached replicas until nbytes fit (for data whose only copy is the host)."""
        return self._make_room(nbytes, None)

    def _make_room(self, nbytes, incoming_reuse, kept=None):
        need = self.backend.block_bytes(nbytes)
        free = self.backend.host_capacity() - self.backend.host_used()
        if need <= free:
            return True
        chosen = []               # the best victims, just enough of them
        for victim in self._victims(incoming_reuse, kept):
            if free >= need:
                break
            free += self.backend.block_bytes(victim.nbytes)
            chosen.append(victim)
        if free < need:
            return False          # not worth (or not possible): bypass the cache
        for victim in chosen:
            self.drop(victim)
        return True

    def _victims(self, incoming_reuse, kept=None):
        """Droppable replicas, best victim first; with a trace, only those used again
        later than the incoming tensor would be. With a spread (`kept`), every replica
        outside it goes first, whenever it is used."""
        if kept is None and self.policy.ranks_by_last_use():
            # LRU: the index keeps that order (a rank would sort every replica per admission)
            return self.registry.index.by_last_use()
        candidates = list(self.registry.droppable_host)
        outside = []
        if kept is not None:
            outside = self.policy.rank([r for r in candidates if r.name not in kept])
            candidates = [r for r in candidates if r.name in kept]
        if incoming_reuse is None or incoming_reuse == float("inf"):
            return outside + self.policy.rank(candidates)
        return outside + self.policy.rank_beyond(candidates, incoming_reuse)

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

