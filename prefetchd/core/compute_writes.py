"""Writes compute made to a resident tensor without the Python API.

Kernels write Parameters in place (BatchNorm's running statistics in training mode, a KV
cache held in a Parameter, an optimizer step), so the guard never sees it. Where the
backend can tell (cpu: an attached home is read-only and its first write faults,
native/include/home_faults.h), every decision to drop a replica as clean asks here
first, and such a write is written back instead of lost.
"""
from .records import State


def note_writes(backend, stats, rec):
    """Dirty rec if compute wrote its resident replica in place since we last looked."""
    if rec.home is not None and rec.state in (State.RESIDENT, State.STORING) \
            and backend.written(rec.home):
        rec.dirty = True
        rec.generation += 1
        stats.compute_writes += 1
