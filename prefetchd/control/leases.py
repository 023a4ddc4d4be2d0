"""Pin leases: a pin taken over the control plane lasts until unpinned or until its
lease runs out without renew(), so a client that dies does not leak pins."""
import heapq
import logging
import secrets
import time
from dataclasses import dataclass

log = logging.getLogger("prefetchd.control.leases")


@dataclass
class Lease:
    names: list
    seconds: float
    expires: float
    owner: bytes = b""


class LeaseTable:
    """Leases of one server; used on its I/O thread only. `unpin(names)` drops the
    daemon's pins; `counters` has leases_granted/expired/released attributes."""

    def __init__(self, unpin, counters):
        self._unpin = unpin
        self._counters = counters
        self._leases = {}
        self._heap = []              # (expires, lease id); stale entries are skipped

    def __len__(self):
        return len(self._leases)

    def __contains__(self, lease_id):
        return lease_id in self._leases

    def grant(self, names, seconds, owner):
        lease_id = secrets.token_hex(8)
        lease = Lease(list(names), seconds, time.monotonic() + seconds, owner)
        self._leases[lease_id] = lease
        heapq.heappush(self._heap, (lease.expires, lease_id))
        self._counters.leases_granted += 1
        return lease_id

    def renew(self, ids, seconds=None):
        """Extend every lease in `ids` (all must exist: see missing()); returns the
        shortest remaining lease in seconds."""
        now = time.monotonic()
        for lease_id in ids:
            lease = self._leases[lease_id]
            if seconds is not None:
                lease.seconds = seconds
            lease.expires = now + lease.seconds
            heapq.heappush(self._heap, (lease.expires, lease_id))
        return min(self._leases[i].seconds for i in ids)

    def missing(self, ids):
        return [i for i in ids if i not in self._leases]

    def release(self, lease_id, expired=False):
        """Drop a lease and its pins; the Lease, or None if there was none."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        if expired:
            self._counters.leases_expired += 1
        else:
            self._counters.leases_released += 1
        try:
            self._unpin(lease.names)
        except Exception as e:  # noqa: BLE001 - a closing daemon drops pins anyway
            log.debug("unpin of lease %s failed: %s", lease_id, e)
        return lease

    def release_all(self):
        for lease_id in list(self._leases):
            self.release(lease_id)

    def expire(self, now):
        """Release every lease whose time is up."""
        while self._heap and self._heap[0][0] <= now:
            _, lease_id = heapq.heappop(self._heap)
            lease = self._leases.get(lease_id)
            if lease is not None and lease.expires <= now:
                log.info("prefetchd server: lease %s on %d tensors expired", lease_id,
                         len(lease.names))
                self.release(lease_id, expired=True)

    def next_expiry(self):
        return self._heap[0][0] if self._heap else None
