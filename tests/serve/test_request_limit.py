"""`prefetchd serve --max-request-bytes`: the operator bounds a request's tensors (and each reply
tensor). A worker's memory grows with the rows of the largest forward it ran and MindSpore's pool
keeps that peak (a 255 MiB request left a demo worker at 12 GB), and the 256 MiB limit was fixed.
The real command and a real client, in a subprocess."""
import subprocess
import sys

import numpy as np
import pytest

from helpers import ENV, start_serve, stop_serve
from prefetchd.serve import Client
from prefetchd.errors import PrefetchdError

SMALL = ["--models", "1", "--hidden", "64", "--layers", "2", "--seq", "8"]
ROW_IN = 8 * 64 * 4               # one row of the demo model's (batch, seq, hidden) float32 input
ROW_OUT = 8 * 256 * 4             # and of its (batch, seq, vocab) output
LIMIT = 16 * ROW_OUT


def test_requests_over_the_configured_limit_are_refused_and_the_server_keeps_serving(tmp_path):
    endpoint = f"ipc://{tmp_path}/limit.sock"
    proc = start_serve(endpoint, [*SMALL, "--max-request-bytes", f"{LIMIT}", "--store",
                                  str(tmp_path / "s")], ENV)
    try:
        rng = np.random.default_rng(0)
        with Client(endpoint, timeout=30) as c:
            (out,) = c.infer("m0", rng.standard_normal((16, 8, 64), dtype=np.float32))
            assert out.shape[0] == 16
            rows_over = LIMIT // ROW_IN + 1                    # its input is over the limit
            with pytest.raises(PrefetchdError, match=f"input 0: shape \\[{rows_over}, 8, 64\\] of float32 is "
                                                     f"{rows_over * ROW_IN} bytes, over the limit of {LIMIT}"):
                c.infer("m0", rng.standard_normal((rows_over, 8, 64), dtype=np.float32))
            with pytest.raises(PrefetchdError, match=f"output 0 would be {17 * ROW_OUT} bytes .* over "
                                                     f"the server's limit of {LIMIT} \\(--max-request-bytes"):
                c.infer("m0", rng.standard_normal((17, 8, 64), dtype=np.float32))     # its output
            (again,) = c.infer("m0", rng.standard_normal((2, 8, 64), dtype=np.float32))
            assert again.shape[0] == 2
    finally:
        assert stop_serve(proc) == 0


@pytest.mark.parametrize("value", ["0", "4095", "5GiB", "-1", "lots"])
def test_a_limit_out_of_range_is_refused_before_anything_starts(value, tmp_path):
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "serve", "--max-request-bytes", value],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 2 and "--max-request-bytes" in out.stderr, out.stderr
    config = tmp_path / "c.toml"
    config.write_text(f'[serve]\nmax_request_bytes = "{value}"\n')
    out = subprocess.run([sys.executable, "-m", "prefetchd.cli", "serve", "--config", str(config)],
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 1 and "[serve] max_request_bytes" in out.stderr, out.stderr
