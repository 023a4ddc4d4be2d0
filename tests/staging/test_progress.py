"""Progress of a long stage: whole lines in a log file while it runs, one `\\r` line on a terminal."""
import io
import os
import subprocess
import sys
import time

import numpy as np

from prefetchd.staging import Progress, stage_checkpoint
from ckpt_files import write_safetensors

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

STAGE = """
import sys
from prefetchd.staging import stage_checkpoint
print(stage_checkpoint(sys.argv[1], sys.argv[2], progress=True, progress_interval=float(sys.argv[3])), flush=True)
"""


def test_progress_lines_reach_a_redirected_file_before_the_stage_ends(tmp_path):
    path = str(tmp_path / "m.safetensors")
    write_safetensors(path, {f"t{i:02d}": np.full(1 << 18, i, np.float32) for i in range(40)})
    env = dict(os.environ, PREFETCHD_FAULTS="write:delay:nth=1:count=100000:delay_ms=50")   # >= 2 s of staging
    log_path = tmp_path / "stage.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", STAGE, path, str(tmp_path / "store"), "0.3"],
                                stdout=subprocess.PIPE, stderr=log, cwd=REPO, env=env, text=True)
    try:
        seen_while_running = None
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            text = open(log_path).read()
            if "prefetchd stage: " in text and proc.poll() is None:
                seen_while_running = text
                break
            time.sleep(0.02)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, open(log_path).read()
    assert seen_while_running, "no progress line in the log while staging ran"
    lines = open(log_path).read().splitlines()
    assert "\r" not in open(log_path).read()
    assert "PREFETCHD_FAULTS=" in lines[0]                # the test switch announces itself
    lines = lines[1:]
    assert len(lines) >= 4, lines                       # periodic, not just the last line
    counts = [int(line.split(": ")[1].split("/")[0]) for line in lines]
    assert counts == sorted(counts) and counts[-1] == 40 and counts[0] < 40
    assert lines[-1].startswith("prefetchd stage: 40/40 tensors, 40.0/40.0 MiB (100%)")
    assert "'tensors': 40" in out


def test_progress_on_a_terminal_rewrites_one_line(tmp_path):
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            assert tty.isatty()
            path = str(tmp_path / "m.safetensors")
            write_safetensors(path, {f"t{i}": np.full(1024, i, np.float32) for i in range(5)})
            stage_checkpoint(path, str(tmp_path / "store"), progress=True, progress_stream=tty,
                             progress_interval=0)
        shown = os.read(master, 1 << 16).decode()
    finally:
        os.close(master)
        os.close(slave)
    assert shown.count("\r") >= 5 and shown.endswith("\r\n")      # the pty turns "\n" into "\r\n"
    assert shown.count("\n") == 1
    assert "prefetchd stage: 5/5 tensors" in shown.rsplit("\r", 2)[-2]


def test_progress_interval_limits_lines_off_a_terminal():
    out = io.StringIO()
    p = Progress(1000, 10, stream=out, interval=3600)
    for i in range(1, 11):
        p.update(i, i * 100)
    assert out.getvalue() == ""
    p.finish()
    assert out.getvalue().startswith("prefetchd stage: 10/10 tensors, 0.0/0.0 MiB (100%)")
    assert out.getvalue().count("\n") == 1 and not p.tty
