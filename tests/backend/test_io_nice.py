"""`io_nice`: the cpu backend's copy-stream threads (disk reads, copies) run at the configured
nice value, so a read's short bursts of work are not queued behind spinning compute threads
(prefetchd/backend/cpu.py, set_nice). Raising a thread's nice needs no privilege; lowering
it below the process's needs CAP_SYS_NICE, and without it the daemon runs as before."""
import logging
import os

import numpy as np
import pytest

from prefetchd.backend import cpu


def _nice(tid):
    # /proc/<pid>/task/<tid>/stat: field 19 is the nice value (after the comm in parentheses)
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])


def _streams(daemon):
    backend = daemon.backend
    return {backend.load_stream, backend.store_stream}


def test_the_copy_stream_threads_take_the_configured_nice(make_daemon):
    daemon = make_daemon(io_nice=7)
    for stream in _streams(daemon):
        assert _nice(stream.native_id) == 7
    # the calling thread keeps its own
    assert _nice(os.getpid()) == os.getpriority(os.PRIO_PROCESS, 0) != 7


@pytest.mark.skipif(os.geteuid() != 0, reason="lowering a nice value needs root (CAP_SYS_NICE)")
def test_the_default_lowers_their_nice_where_permitted(make_daemon):
    daemon = make_daemon()
    assert daemon.config.io_nice == -10
    for stream in _streams(daemon):
        assert _nice(stream.native_id) == -10


def test_without_permission_the_daemon_says_so_and_still_reads(make_daemon, make_param, monkeypatch, caplog):
    def refuse(which, who, nice):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(cpu.os, "setpriority", refuse)
    with caplog.at_level(logging.INFO, logger="prefetchd"):
        daemon = make_daemon(io_nice=-5)
    assert "io_nice -5 not applied to the load stream's thread (Operation not permitted)" in caplog.text
    for stream in _streams(daemon):
        assert _nice(stream.native_id) == os.getpriority(os.PRIO_PROCESS, 0)
    value = np.arange(1 << 18, dtype=np.float32)
    handle = daemon.register(make_param(value, "w"), tier="remote")     # a disk write, then a read
    with daemon.use(handle):
        np.testing.assert_array_equal(handle.target.asnumpy(), value)
