"""offload -> handle.close() -> daemon.close(), over and over, is flat: the model, the
handle and the Daemon are freed, and with them the daemon's address-space reservation
(64 GiB of homes on the CPU backend), its mappings and threads.

MindSpore's backward-pre-hook primitive held the model through a closure its C++ side
keeps (prefetchd/hooks/backward.py): every cycle leaked everything, and under an
address-space limit the 5th cycle failed. The model's gradient refusal is a primitive of
its own now, whose hook holds nothing of the model. The cycles run in a
child (tests/hooks/_offload_cycles_child.py): RLIMIT_AS, /proc/self/maps and VmSize are
the child's own."""
import json
import os
import subprocess
import sys

import pytest

from prefetchd.core.homes import CHUNK

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run_cycles(tmp_path, cycles, slack=None, usage="closed"):
    argv = [sys.executable, os.path.join(HERE, "_offload_cycles_child.py"), str(tmp_path), str(cycles)]
    argv += ["-" if slack is None else str(slack), usage]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return proc, rows


@pytest.mark.parametrize("usage", ["closed", "readme", "dropped"])
def test_cycles_free_the_model_the_handle_and_the_daemon_and_stay_flat(tmp_path, usage):
    # readme: `with Daemon(...)` and no handle.close(), as the README shows it. The
    # backward-hook cycle kept every such model, handle and daemon (64 GiB of address
    # space each: ENOMEM after ~2046 rounds) until the daemon's close let go of it.
    # dropped: neither closed; the cycle kept them, and the daemon's thread, until exit.
    proc, rows = run_cycles(tmp_path, 6, usage=usage)
    assert proc.returncode == 0, (rows, proc.stderr[-2000:])
    assert len(rows) == 6
    for row in rows:
        assert row["alive"] == [False, False, False], row      # model, handle, daemon
    first, last = rows[0], rows[-1]
    # One leaked reservation is 64 GiB; a flat process grows by less than one block of malloc.
    assert last["vm_kib"] - first["vm_kib"] < (256 << 20) // 1024, rows
    assert last["maps"] - first["maps"] <= 4, rows
    assert last["threads"] == first["threads"], rows


def test_cycles_run_under_an_address_space_limit(tmp_path):
    # Room for 3.5 reservations beyond what the first cycle left mapped: a leaking cycle
    # fails at the 5th (OutOfSpace / MemoryError), a flat one runs any number.
    proc, rows = run_cycles(tmp_path, 8, slack=int(3.5 * CHUNK))
    assert proc.returncode == 0, (rows, proc.stderr[-2000:])
    assert [row["cycle"] for row in rows] == list(range(8))
    assert all(row["alive"] == [False, False, False] for row in rows), rows
