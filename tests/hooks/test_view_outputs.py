"""Cells that return views of their own weights (prefetchd/hooks/views.py).

`self.pos_embed[:, :n]`, a transpose, a reshape or the Parameter itself share the
weight's storage; read after the unit was released, they were pages no longer
mapped and the process died (SIGSEGV). Each model runs in a child process
(tests/_view_outputs_model.py) so a regression fails this test instead of
killing the test run; outputs must equal the resident model's on every pass,
after every replica was evicted, and after the daemon closed.
"""
import collections
import os
import subprocess
import sys

import numpy as np
import pytest

from prefetchd.hooks import views as aliases

CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_view_outputs_model.py")


@pytest.mark.parametrize("kind", ["slice", "offset_slice", "transpose", "reshape", "itself", "tuple", "root",
                                  "part", "plain", "dataclass", "namespace", "cycle"])
def test_a_view_of_a_units_weight_outlives_the_unit(tmp_path, kind):
    run = subprocess.run([sys.executable, CHILD, kind, str(tmp_path)], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.endswith("ok\n"), (run.returncode, run.stdout, run.stderr[-3000:])


def test_copy_positions_copies_only_the_views_and_keeps_the_structure(ms):
    Pair = collections.namedtuple("Pair", "a b")
    t = [ms.Tensor(np.full((2,), i, np.float32)) for i in range(4)]
    out = (t[0], [t[1], {"k": t[2]}], Pair(t[3], 7))
    copied = aliases.copy_positions(out, (1, 3))
    flat = aliases.flat_tensors(copied)
    assert [f is o for f, o in zip(flat, t)] == [True, False, True, False]
    assert [float(f.asnumpy()[0]) for f in flat] == [0.0, 1.0, 2.0, 3.0]
    assert isinstance(copied[2], Pair) and copied[2].b == 7 and isinstance(copied[1][1], dict)
    # A structure with fewer tensors than the positions found: everything is copied.
    assert aliases.flat_tensors(aliases.copy_positions(t[0], (1,)))[0] is not t[0]
