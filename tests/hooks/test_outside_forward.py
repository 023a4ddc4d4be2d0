"""Using an offloaded model's weights outside its forward (docs/daemon-api.md, "Reading
weights outside a forward").

A weight that is not resident has its home unmapped, so anything that hands it to a
MindSpore kernel outside a forward or `daemon.use` used to kill the process with SIGSEGV:
save_checkpoint, ops.assign (a KV-cache reset), ops.norm, `w * 2`, a @jit call, pickling.
Now prefetchd's guard refuses them with NotResidentError naming the tensor and
`daemon.use`. Each case runs in a child process (tests/_outside_forward_child.py), so a
regression fails the test instead of killing the test run; after the refusal the child
checks that the model still gives the resident model's output (nothing was written).
"""
import os
import subprocess
import sys

import pytest

CHILD = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_outside_forward_child.py")
NATIVE_LINE = "prefetchd: a managed tensor was read while it was not resident"


def run_child(case, tmp_path):
    return subprocess.run([sys.executable, "-X", "faulthandler", CHILD, case, str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "GLOG_v": "3"})


def refusal(run):
    return next((line for line in run.stdout.splitlines() if line.startswith("refused: ")), None)


@pytest.mark.parametrize("case", ["save_checkpoint", "save_checkpoint_list", "assign", "norm", "method", "operator",
                                  "second_argument", "jit_argument", "pickle", "deepcopy", "data"])
def test_a_kernel_on_a_weight_that_is_not_resident_is_refused_by_name(tmp_path, case):
    run = run_child(case, tmp_path)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-3000:])
    assert NATIVE_LINE not in run.stderr
    line = refusal(run)
    assert line is not None and line.startswith("refused: NotResidentError: refused "), run.stdout
    assert "tensor 'blocks." in line and "daemon.use([...])" in line, line
    assert "not supported" in line, line      # training through the model: said once, here
    assert run.stdout.endswith("ok\n"), run.stdout   # and the model still gives the resident answer


def test_inside_use_the_same_actions_work_and_writes_are_kept(tmp_path):
    run = run_child("use", tmp_path)
    assert run.returncode == 0 and run.stdout.endswith("ok\n"), (run.returncode, run.stdout, run.stderr[-3000:])
    assert "use: norm, ops, jit and save_checkpoint give the resident values" in run.stdout
    assert "use: ops.assign and set_data are kept through an eviction" in run.stdout
    assert "use: arrays taken inside use stay readable after the weight is evicted" in run.stdout


@pytest.mark.parametrize("case", ["grad_input", "grad_weights", "value_and_grad", "grad_of_loss", "vjp",
                                  "grad_operation"])
def test_gradients_through_an_offloaded_model_are_refused(tmp_path, case):
    """The backward would read weights released after their forward (SIGSEGV before): the
    model's backward pre-hook refuses before any backward kernel runs, and plain forwards
    afterwards still give the resident answer."""
    run = run_child(case, tmp_path)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    line = refusal(run)
    assert line is not None and line.startswith(
        "refused: PrefetchdError: prefetchd: gradients through an offloaded model are not supported"), run.stdout
    assert run.stdout.endswith("ok\n"), run.stdout


@pytest.mark.xfail(strict=True, reason="not covered: these reach the tensor's memory without MindSpore's "
                   "per-argument dispatch (a sequence argument, Tensor(p)'s shallow copy, a base "
                   "class's method called directly)")
@pytest.mark.parametrize("case", ["stack", "tensor_alias", "base_method"])
def test_entry_points_the_guard_cannot_see_are_refused(tmp_path, case):
    run = run_child(case, tmp_path)
    assert run.returncode == 0 and refusal(run) is not None, (run.returncode, run.stdout, run.stderr[-2000:])


def test_a_native_read_the_guard_cannot_see_still_says_why_before_the_process_dies(tmp_path):
    """ops.stack((w, w)) is not refused (above); the process dies, but says why first."""
    run = run_child("stack", tmp_path)
    assert run.returncode == -11, (run.returncode, run.stdout, run.stderr[-2000:])
    assert NATIVE_LINE in run.stderr, run.stderr[-2000:]


def test_a_frozen_backbone_under_a_trained_head_is_not_refused(tmp_path):
    """Under ops.stop_gradient no backward of the model runs: the head's gradients are
    computed and the forward under the gradient gives the resident answer."""
    run = run_child("frozen_backbone", tmp_path)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert "frozen backbone: head gradients computed\nno error\n" in run.stdout, run.stdout
    assert run.stdout.endswith("ok\n"), run.stdout


DICT_OUTPUT = """
import sys
import numpy as np
import mindspore as ms
from mindspore import nn
import prefetchd
ms.set_device("CPU")
ms.set_seed(2)

class Blocks(nn.Cell):                     # a transformers-style output: a dict of tensors
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.blocks = nn.CellList([nn.Dense(256, 256) for _ in range(4)])

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return {"logits": x} if self.kind == "dict" else [x] if self.kind == "list" else ((x,), x)

net = Blocks(sys.argv[2])
x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32))
with prefetchd.Daemon(device_budget=700000, store_dir=sys.argv[1]) as d:
    prefetchd.offload(net, d, lookahead=1)
    first = lambda out: out["logits"] if isinstance(out, dict) else out[0] if sys.argv[2] == "list" else out[0][0]
    ref = first(net(x)).asnumpy()
    try:
        ms.value_and_grad(lambda v: first(net(v)).sum(), 0)(x)
        print("not refused", flush=True)
    except prefetchd.PrefetchdError as e:
        print("refused:", str(e)[:70], flush=True)
    assert np.array_equal(first(net(x)).asnumpy(), ref)
print("ok", flush=True)
"""


@pytest.mark.xfail(strict=True, reason="not covered: MindSpore's backward hook wraps a Tensor output or a "
                   "tuple's Tensors only, so this backward runs over released weights (SIGSEGV); a "
                   "refusal at the forward left PyNative's requires_grad() True for later plain forwards")
@pytest.mark.parametrize("kind", ["dict", "list", "nested_tuple"])
def test_a_gradient_through_an_output_the_backward_hook_cannot_see_is_refused(tmp_path, kind):
    """The backward of a model returning a dict (mindone's Qwen2 ModelOutput), a list or a
    nested tuple passes the model's backward pre-hook by (docs/daemon-api.md, not covered)."""
    run = subprocess.run([sys.executable, "-c", DICT_OUTPUT, str(tmp_path / "s"), kind],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert "refused: prefetchd: gradients through an offloaded model are not supported" in run.stdout, run.stdout
    assert run.stdout.endswith("ok\n"), run.stdout
