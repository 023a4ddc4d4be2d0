"""prefetchd.serve.Client without a server (every future completes: timeout,
close) and the runnable example of docs/control-plane.md, run as a script."""
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import ENV, REPO
from prefetchd.control import RequestTimeout
from prefetchd.errors import ShutdownError
from prefetchd.serve import Client


def _nobody(tmp_path):
    return f"ipc://{tmp_path}/nobody.sock"


def test_a_request_nobody_answers_times_out_in_bounded_time(tmp_path):
    with Client(_nobody(tmp_path)) as c:
        started = time.monotonic()
        f = c.submit("m0", np.zeros((1, 4), np.float32), timeout=0.5)
        with pytest.raises(RequestTimeout):
            f.result(5)
        assert time.monotonic() - started < 2
        with pytest.raises(RequestTimeout):
            c.infer("m0", np.zeros((1, 4), np.float32), timeout=0.3)


def test_close_fails_every_outstanding_future(tmp_path):
    c = Client(_nobody(tmp_path))
    futures = [c.submit("m0", np.zeros((1, 4), np.float32), timeout=60) for _ in range(5)]
    started = time.monotonic()
    c.close()
    assert time.monotonic() - started < 6
    for f in futures:
        with pytest.raises(ShutdownError):
            f.result(1)
    with pytest.raises(ShutdownError):
        c.submit("m0", np.zeros((1, 4), np.float32))


def test_the_documented_example_runs(tmp_path):
    text = open(os.path.join(REPO, "docs", "control-plane.md")).read()
    block = re.search(r"<!-- example: serve-client -->\s*```python\n(.*?)```", text, re.S)
    assert block, "the example is gone from docs/control-plane.md"
    script = tmp_path / "example.py"
    script.write_text(block.group(1))
    out = subprocess.run([sys.executable, str(script)], env=ENV, capture_output=True, text=True,
                         timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "(2, 8, 256) True", out.stdout
