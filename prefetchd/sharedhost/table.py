"""The shared blocks and their leases, within the tier's byte budget (no I/O, no threads).

A block is keyed by (tensor name, store version). Each attached process' leases are
counted on its connection and on the block; a block with any lease is never dropped,
and an idle ready block is dropped only to make room, in the order prefetchd.sharedhost
.policy ranks the attached processes' traces. The owner's thread calls everything here,
under the owner's lock.
"""
from . import policy


class Entry:
    """One shared block: ready once filled; `waiters` are the (connection, item index)
    of the acquires waiting for it."""

    def __init__(self, block):
        self.block = block
        self.key = block.key
        self.ready = False
        self.leases = 0
        self.waiters = []
        self.last_use = 0


class BlockTable:
    def __init__(self, budget, counters):
        self.budget = budget
        self._entries = {}          # (key, version) -> Entry
        self._counters = counters
        self._tick = 0

    def get(self, ident):
        return self._entries.get(ident)

    def add(self, ident, block):
        entry = self._entries[ident] = Entry(block)
        return entry

    def discard(self, ident):
        """Forget a block (its fill failed) and unmap it."""
        entry = self._entries.pop(ident, None)
        if entry is not None:
            entry.block.close()

    def lease(self, conn, ident, entry):
        """conn holds one more lease on entry (from its acquire until its release)."""
        self._tick += 1
        entry.leases += 1
        entry.last_use = self._tick
        conn.leases[ident] += 1

    def unlease(self, conn, ident, n=1):
        """conn gives back n leases on ident; False if it did not hold them."""
        if conn.leases.get(ident, 0) < n:
            return False
        conn.leases[ident] -= n
        if not conn.leases[ident]:
            del conn.leases[ident]
        entry = self._entries.get(ident)
        if entry is not None:
            entry.leases -= n
        return True

    def release_all(self, conn):
        """Every lease conn held (its connection closed); returns how many."""
        released = 0
        for ident, n in list(conn.leases.items()):
            entry = self._entries.get(ident)
            if entry is not None:
                entry.leases -= n
                released += n
                entry.waiters = [w for w in entry.waiters if w[0] is not conn]
        conn.leases.clear()
        return released

    def make_room(self, need, traces):
        """Drop idle ready blocks until `need` more bytes fit; False (dropping nothing) if
        even every idle block would not make room."""
        used = self.used()
        if used + need <= self.budget:
            return True
        idle = [e for e in self._entries.values() if e.ready and e.leases == 0]
        victims = policy.rank(idle, traces)
        if used - sum(e.block.size for e in victims) + need > self.budget:
            return False
        for victim in victims:
            if used + need <= self.budget:
                break
            used -= victim.block.size
            del self._entries[(victim.block.key, victim.block.version)]
            victim.block.close()
            self._counters["evictions"] += 1
        return True

    def used(self):
        return sum(e.block.size for e in self._entries.values())

    def summary(self):
        entries = self._entries.values()
        return {"bytes": self.used(), "blocks": sum(1 for e in entries if e.ready),
                "filling": sum(1 for e in entries if not e.ready),
                "leases": sum(e.leases for e in entries)}

    def close(self):
        for entry in self._entries.values():
            entry.block.close()
        self._entries.clear()
