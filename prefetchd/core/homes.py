"""Homes: the one virtual address each managed tensor keeps for life.

The framework tensor is bound to its home once, at registration. Residency
then changes what is mapped there (the backend's attach/detach move a device
block's pages in and out), never where the framework points: no rebinds,
and a compiled graph that captured the address keeps reading the right
bytes. Homes are carved in registration order out of large address-space
reservations (no memory behind them), so a unit's tensors, registered
together, sit side by side; tensors of 2 MiB or more start on a 2 MiB
boundary (huge pages). Offsets and sizes are multiples of the backend's
`granularity` (a page on CPU; 2 MiB under ACL/CUDA virtual memory).
"""
from .. import _native

PAGE = 4096
HUGE = _native.HUGE_PAGE
CHUNK = 64 << 30      # address space per reservation: costs no memory, one mapping


def _round_up(n, to):
    return -(-n // to) * to


class HomeSpace:
    def __init__(self, backend):
        self._backend = backend
        self._range = None
        self._size = 0
        self._next = 0

    @staticmethod
    def supported(backend):
        return callable(getattr(backend, "attach", None)) and callable(getattr(backend, "reserve", None))

    def carve(self, nbytes):
        """A new home of nbytes (its pages: nbytes rounded up to whole pages), or None for
        an empty tensor (nothing to map; it keeps the rebinding path)."""
        if nbytes <= 0:
            return None
        grain = getattr(self._backend, "granularity", PAGE)
        size = _round_up(nbytes, grain)
        offset = _round_up(self._next, max(grain, HUGE) if size >= HUGE else grain)
        if self._range is None or offset + size > self._size:
            self._size = max(CHUNK, _round_up(size, HUGE))
            self._range = self._backend.reserve(self._size)
            offset = 0
        self._next = offset + size
        return self._backend.home(self._range, offset, nbytes)
