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

Where the backend parks (`parks`: cpu), the drop does not move the pages at all while
the host tier keeps the block: it detaches the device slot and leaves the pages under
the home, PROT_NONE (`park`; `rec.host_parked`), so a stray read still faults. The
next load makes them readable again (`attach_parked`: no page move, no TLB
shootdown), and the host cache takes them back (`unpark`) only when it drops the
block. A mremap flushes the TLB once per 2 MiB moved on every core computing; a
park flushes once per tensor. The host budget still counts the block, the device
budget only the slot while resident. docs/stable-addresses.md, "Parked pages".

A load from a shared host tier (prefetchd/sharedhost) maps the owner's block over the
device block, and the attach moves that mapping under the home. Where the owner's
budget holds the whole store, so that no block is ever dropped for room, the drop
parks that mapping the same way (`park_mapping`; `rec.mapping_parked`, the lease kept
by the backend), and the next load unparks it (`unpark_mapping`): no request to the
owner, no mapping, no page move.

Lending needs a home: a dropped replica waiting for its fence is taken back by
`Loads.reclaim` through its home before any new load starts, so no load ever reads
a host block whose pages are still out.
"""
import logging
import time

log = logging.getLogger("prefetchd")


def timed(stats, move, *args, protect=False):
    """Run one page move (a lend, a give-back, a home's attach or detach) or, with
    `protect`, one permission change (a park or unpark), and count its wall time."""
    t = time.perf_counter_ns()
    try:
        return move(*args)
    finally:
        stats.page_move_seconds += (time.perf_counter_ns() - t) / 1e9
        if protect:
            stats.page_protects += 1
        else:
            stats.page_moves += 1


def can_lend(backend, rec):
    """Whether rec's load from its host replica can move the pages under its home."""
    lends = getattr(backend, "lends", None)
    return rec.home is not None and callable(lends) and lends(rec.host_block)


def page_move_load(backend, rec):
    """Whether rec's next load puts its bytes under its home by a page move or a permission
    change alone, moving no byte: a shared-tier mapping or host pages parked there, or a
    host replica the backend lends. Loads.start takes that path exactly then; the hooks'
    prefetch window counts the other loads (disk reads, copies) as the ones that take time."""
    if rec.mapping_parked or rec.host_parked:
        return True
    return rec.host_valid and can_lend(backend, rec)


def lend(backend, stats, rec):
    """Put rec's host replica's pages under its home, attached to rec.block (no copy):
    made readable where they are parked there, else moved from the host block."""
    if rec.host_parked:
        timed(stats, backend.attach_parked, rec.home, rec.block, protect=True)
        rec.host_parked = False
        stats.unparked_bytes += rec.nbytes
    else:
        timed(stats, backend.attach_lent, rec.home, rec.block, rec.host_block)
    rec.host_lent = True
    stats.moved_bytes += rec.nbytes


def give_back(backend, stats, rec, block):
    """Take lent pages off rec's home (attached to its device `block`) and give them to
    the host tier while it keeps the block: parked under the home where the backend
    parks, else moved back under the host block. False if rec holds no lent pages (the
    caller detaches as usual); a lent replica the host cache dropped meanwhile has
    host_lent cleared (hostcache.drop), so its pages go into the block and are freed
    with it."""
    if not rec.host_lent:
        return False
    rec.host_lent = False
    stats.returned_bytes += rec.nbytes
    if getattr(backend, "parks", False) and _park(backend, stats, rec, block, "moving its pages back"):
        rec.host_parked = True
        return True
    timed(stats, backend.detach_lent, rec.home, block, rec.host_block)
    return True


def _park(backend, stats, rec, block, fallback):
    """Park rec's pages under its home (detaching `block`); False, logged, if the kernel
    refuses (e.g. its mapping limit): the caller then does `fallback` instead."""
    try:
        timed(stats, backend.park, rec.home, block, protect=True)
    except Exception as e:
        log.warning("prefetchd: parking %r under its home failed (%s); %s", rec.name, e, fallback)
        return False
    stats.parked_bytes += rec.nbytes
    return True


def park_mapping(backend, stats, rec, block):
    """Park a dropped replica whose pages map a shared-tier block under its home, lease
    held, where the backend allows it (the owner's budget holds the whole store). True
    if parked; False: the caller detaches as usual."""
    parks_mapping = getattr(backend, "parks_mapping", None)
    if not callable(parks_mapping) or not parks_mapping(block) or not _park(backend, stats, rec, block,
                                                                            "detaching its shared mapping"):
        return False
    rec.mapping_parked = True
    return True


def unpark_mapping(backend, stats, rec):
    """rec's parked shared-tier mapping readable again under its home, attached to rec.block."""
    timed(stats, backend.attach_parked, rec.home, rec.block, protect=True)
    rec.mapping_parked = False
    stats.moved_bytes += rec.nbytes
    stats.unparked_bytes += rec.nbytes


def release_home(backend, stats, rec, block):
    """Take a dropped replica's pages off its home (attached to `block`, about to be
    freed): lent pages to the host tier, a shared mapping parked where it may be, else
    the pages back onto the block."""
    if not give_back(backend, stats, rec, block) and not park_mapping(backend, stats, rec, block):
        timed(stats, backend.detach, rec.home, block)


def drop_parked(backend, stats, rec, *, mappings=False):
    """The host tier frees rec's host block: the host pages parked under the home are
    freed (the remote copy is the truth then). With `mappings` (the daemon closes) a
    parked shared mapping goes too, and its lease ends. No-op unless rec is parked so."""
    if not (rec.host_parked or (mappings and rec.mapping_parked)):
        return
    rec.host_parked = rec.mapping_parked = False
    try:
        timed(stats, backend.unpark, rec.home, protect=True)
    except Exception as e:   # the home keeps them, unreadable, until it goes; its next attach says why
        log.error("prefetchd: freeing the pages parked under %r failed: %s", rec.name, e)
