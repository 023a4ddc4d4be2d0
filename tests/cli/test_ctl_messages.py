"""What `prefetchd ctl` and `prefetchd status` print, run as a user runs them: a
watermark that is no finite number is said to be one (it was "not negative"), and a
fresh serve front's status has no empty `counters ` line."""
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest

from helpers import ENV, start_serve, stop_serve


def run(*args, env=ENV):
    return subprocess.run([sys.executable, "-m", "prefetchd.cli", *args], capture_output=True, text=True,
                          env=env, timeout=60)


@pytest.mark.parametrize("value, says", [("nan", "a finite number"), ("inf", "a finite number"),
                                         ("1e400", "a finite number"), ("-inf", "a finite number"),
                                         ("-1", "not negative"), ("-5%", "not negative")])
def test_set_watermarks_says_what_is_wrong_with_a_number(value, says):
    out = run("ctl", "--endpoint", "tcp://127.0.0.1:9", "set-watermarks", "--", value)
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert line.startswith("prefetchd: error: ctl set-watermarks:") and line.endswith(says), line
    assert repr(value) in line


def test_status_of_a_fresh_front_has_no_empty_counters_line(tmp_path):
    # Short: a worker's ipc paths must fit in sun_path's 107 bytes.
    run_dir = tempfile.mkdtemp(prefix="pfd-", dir="/tmp")
    env = dict(ENV, XDG_RUNTIME_DIR=str(run_dir))
    endpoint = f"ipc://{run_dir}/fresh-{secrets.token_hex(2)}.sock"     # this process finds it too
    proc = start_serve(endpoint, ["--models", "1", "--hidden", "64", "--layers", "2", "--seq", "8",
                                  "--store", str(tmp_path / "store")], env)
    try:
        out = run("status", "--endpoint", endpoint, env=env)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith("serve front ")
        counters = [x for x in lines if x.startswith("counters")]
        assert len(counters) == 1 and counters[0].strip() != "counters", out.stdout
    finally:
        assert stop_serve(proc) == 0
        shutil.rmtree(run_dir, ignore_errors=True)
