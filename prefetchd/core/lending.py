"""Host blocks lent to the device tier, and the time spent moving pages.

Where the device and host tiers are the same RAM (the cpu backend), a load from
the host tier does not copy: the backend moves the host block's pages straight
under the tensor's home (`attach_lent`), so a weight's bytes live in one place at a
time. The device block is attached holding none of them: it is the device budget's
slot. The host block stays allocated, counted in the host budget as the slot its
pages come back to, but holds nothing meanwhile (`rec.host_lent`). When the drop
takes the pages off the home (after the compute fence of its last reader, like any
drop), they move straight back under the host block if the host tier still keeps
it (`detach_lent`), or into the device block, to be freed with it, if the host
cache dropped it meanwhile (the remote copy is the truth then). One page move in,
one out, per tensor per pass. docs/stable-addresses.md, "Zero-copy tiers".

Lending needs a home: a dropped replica waiting for its fence is taken back by
`Loads.reclaim` through its home before any new load starts, so no load ever reads
a host block whose pages are still out.
"""
import time


def timed(stats, move, *args):
    """Run one page move (a lend, a give-back, a home's attach or detach) and count its wall time."""
    t = time.perf_counter_ns()
    try:
        return move(*args)
    finally:
        stats.page_move_seconds += (time.perf_counter_ns() - t) / 1e9
        stats.page_moves += 1


def can_lend(backend, rec):
    """Whether rec's load from its host replica can move the pages under its home."""
    lends = getattr(backend, "lends", None)
    return rec.home is not None and callable(lends) and lends(rec.host_block)


def lend(backend, stats, rec):
    """Move rec's host replica's pages under its home, attached to rec.block (no copy)."""
    timed(stats, backend.attach_lent, rec.home, rec.block, rec.host_block)
    rec.host_lent = True
    stats.moved_bytes += rec.nbytes


def give_back(backend, stats, rec, block):
    """Take lent pages off rec's home (attached to its device `block`): back under the
    host block while the host tier keeps it. False if rec holds no lent pages (the
    caller detaches as usual); a lent replica the host cache dropped meanwhile has
    host_lent cleared (hostcache.drop), so its pages go into the block and are freed
    with it."""
    if not rec.host_lent:
        return False
    rec.host_lent = False
    timed(stats, backend.detach_lent, rec.home, block, rec.host_block)
    stats.returned_bytes += rec.nbytes
    return True
