"""Transfers in flight, by tag.

Every asynchronous move the scheduler starts on a copy stream gets a tag; its
completion comes back from the backend carrying that tag, and the table says
what it was for.
"""
import itertools

from .. import _native
from ..backend.base import TransferKind
from ..errors import IntegrityError, StorageError

LOAD_KINDS = (TransferKind.LOAD, TransferKind.H2D)


def _is_load(kind, req):
    """Loads into the device tier, including a disk read into the host cache on the
    way to the device (a STAGE with no request of its own)."""
    return kind in LOAD_KINDS or (kind is TransferKind.STAGE and req is None)


class Transfers:
    """tag -> (kind, record, request or None). Scheduler thread only."""

    def __init__(self):
        self._tags = itertools.count(1)
        self._entries = {}
        self.loads = 0             # loads into the device tier in flight

    def add(self, kind, rec, req=None):
        """Register a transfer about to start; returns its tag."""
        tag = next(self._tags)
        self._entries[tag] = (kind, rec, req)
        if _is_load(kind, req):
            self.loads += 1
        return tag

    def pop(self, tag):
        """The transfer a completion belongs to, or None if it is unknown (already settled)."""
        entry = self._entries.pop(tag, None)
        if entry is not None and _is_load(entry[0], entry[2]):
            self.loads -= 1
        return entry

    def discard(self, tag):
        """Forget a transfer that failed to start."""
        self.pop(tag)

    def involves(self, rec):
        """True if a transfer of rec is in flight."""
        return any(entry[1] is rec for entry in self._entries.values())

    def __len__(self):
        return len(self._entries)

    def __bool__(self):
        return bool(self._entries)


def transfer_error(stats, op, rec, c):
    """The error a failed completion `c` of `op` ("read", "write", "verify") on rec means,
    counted in stats: IntegrityError for a checksum mismatch, else StorageError."""
    if c.status == _native.STATUS_CHECKSUM:
        stats.checksum_failures += 1
        return IntegrityError(f"{op} of {rec.name!r} failed verification: {c.message}")
    stats.io_errors[op if op in ("read", "write") else "read"] += 1
    return StorageError(f"{op} of {rec.name!r} failed: {c.message}")
