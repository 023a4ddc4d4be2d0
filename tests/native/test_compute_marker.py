"""Compute markers used from several threads at once (a server's request threads, two models).

MindSpore 2.10 breaks its op queue for good when two threads dispatch ops at
the same moment (docs/mindspore-notes.md), so the check runs in a child process.
"""
import json
import os
import subprocess
import sys

from helpers import ENV

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # tests/, where the child scripts are


def test_markers_and_first_uses_from_several_threads_at_once_leave_mindspore_working(tmp_path):
    run = subprocess.run([sys.executable, os.path.join(HERE, "_marker_threads.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300, env=ENV)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["markers"] == ["ok"] * 12, got["markers"]
    assert got["uses"] == ["ok"] * 3, got["uses"]
    assert got["one_marker"], "threads that raced to the first use built separate markers"
    assert got["synchronize"] == "ok", got["synchronize"]
