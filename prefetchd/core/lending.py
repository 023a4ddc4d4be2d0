"""Host blocks lent to the device tier, and the time spent moving pages.

Where the device and host tiers are the same RAM (the cpu backend), a load from
the host tier does not copy: the backend moves the host block's pages under the
device block (`fill_from_host(..., lend=True)`), so a weight's bytes live in one
place at a time. The host block stays allocated, counted in the host budget as the
slot its pages come back to, but holds nothing meanwhile (`rec.host_lent`). When
the device block is freed (after the compute fence of its last reader, like any
drop), the pages move back under the host block if the host tier still keeps it,
or are freed with the device block if the host cache dropped it meanwhile (the
remote copy is the truth then). docs/stable-addresses.md, "Zero-copy tiers".

Lending needs a home: a dropped replica waiting for its fence is taken back by
`Loads.reclaim` through its home before any new load starts, so no load ever reads
a host block whose pages are still out.
"""
import time


def count(stats, seconds):
    """One page move (a fill, a return, a home's attach or detach) took `seconds`."""
    stats.page_move_seconds += seconds
    stats.page_moves += 1


def timed(stats, move, *args):
    """Run one page move and count its wall time."""
    t = time.perf_counter_ns()
    try:
        return move(*args)
    finally:
        count(stats, (time.perf_counter_ns() - t) / 1e9)


def give_back(backend, stats, rec, block):
    """Before rec's device `block` (detached) is freed: pages lent by the host block go
    back under it while the host tier keeps it; else they are freed with the block."""
    if not rec.host_lent:
        return
    rec.host_lent = False
    if rec.host_block is None:
        return
    timed(stats, backend.return_to_host, rec.host_block, block)
    stats.returned_bytes += rec.nbytes
