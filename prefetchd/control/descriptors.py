"""The process's file descriptors: how many are in use, and raising the soft limit.

A server's connection guard (prefetchd.control.connections) admits and pauses by
these counts: every connection libzmq accepts is a descriptor of this process.
"""
import errno
import logging
import os
import resource

from ..limits import raise_open_files

log = logging.getLogger("prefetchd.control.descriptors")

MAX_RAISED_FD_LIMIT = 1 << 16
LOW_FD_LIMIT = 4096       # below it, a burst of connects can outrun the guard (warned at start)


def open_descriptors():
    """Descriptors open in this process now: the soft limit when the table is too full
    to list it (listing takes a descriptor; it said 0 there, and the guard let a full
    table go on accepting), 0 without /proc."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError as e:
        if e.errno in (errno.EMFILE, errno.ENFILE):
            return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return 0


def raise_fd_limit(cap=MAX_RAISED_FD_LIMIT):
    """Raise the soft RLIMIT_NOFILE to the hard one (at most `cap`), as Go's runtime does
    at start: the common 1024 soft limit is the cliff libzmq falls off. Returns the new
    soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(cap, hard if hard != resource.RLIM_INFINITY else cap)
    if soft != resource.RLIM_INFINITY and soft < want:
        if raise_open_files(want) is None:
            log.info("prefetchd server: raised the descriptor limit from %d to %d", soft, want)
            return want
        log.warning("prefetchd server: could not raise the descriptor limit from %d to %d", soft, want)
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if limit != resource.RLIM_INFINITY and limit < LOW_FD_LIMIT:
        # libzmq's ipc listener aborts the process at EMFILE, and a burst of connects
        # accepted faster than the guard sheds them can get there (an outside probe: 2,000
        # at once at a hard limit of 256, with the old code and the new).
        log.warning("prefetchd server: the descriptor limit is %d (hard %s): a burst of connections "
                    "at once can exhaust it before they are shed, and libzmq then aborts the process; "
                    "raise the hard limit (ulimit -Hn, systemd LimitNOFILE=) to %d or more",
                    limit, hard, LOW_FD_LIMIT)
    return limit
