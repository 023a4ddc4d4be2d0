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


def run_script(script, tmp_path, *args):
    """Run `script` from a file (the planner reads a construct's source: under -c it has none)
    with a store directory and `args`."""
    path = tmp_path / "child.py"
    path.write_text(script)
    return subprocess.run([sys.executable, "-X", "faulthandler", str(path), str(tmp_path / "s"), *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def assert_gradient_refused(run):
    """The child's gradient was refused, and its plain forwards afterwards were right."""
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert "refused: prefetchd: gradients through an offloaded model are not supported" in run.stdout, run.stdout
    assert run.stdout.endswith("ok\n"), run.stdout


def refusal(run):
    return next((line for line in run.stdout.splitlines() if line.startswith("refused: ")), None)


@pytest.mark.parametrize("case", ["save_checkpoint", "save_checkpoint_list", "assign", "norm", "method", "operator",
                                  "second_argument", "jit_argument", "pickle", "deepcopy", "data", "stack", "addn",
                                  "stack_namedtuple", "tensor_alias", "base_method", "parameter_base_method",
                                  "base_item", "native_getitem", "native_op"])
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


def test_a_native_read_the_guard_cannot_see_still_says_why_before_the_process_dies(tmp_path):
    """MindSpore's native class's __repr__ called directly is not refused; the process dies,
    but says why first."""
    run = run_child("native_repr", tmp_path)
    assert run.returncode == -11, (run.returncode, run.stdout, run.stderr[-2000:])
    assert NATIVE_LINE in run.stderr, run.stderr[-2000:]


def test_a_frozen_backbone_under_a_trained_head_is_not_refused(tmp_path):
    """Under ops.stop_gradient no backward of the model runs: the head's gradients are
    computed and the forward under the gradient gives the resident answer."""
    run = run_child("frozen_backbone", tmp_path)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert "frozen backbone: head gradients computed\nno error\n" in run.stdout, run.stdout
    assert run.stdout.endswith("ok\n"), run.stdout


NESTED_OUTPUT = """
import collections
import sys
import numpy as np
import mindspore as ms
from mindspore import nn, ops
import prefetchd
ms.set_device("CPU")
ms.set_seed(2)
Pair = collections.namedtuple("Pair", "logits extra")


class Output(collections.OrderedDict):     # a ModelOutput: an OrderedDict whose fields are attributes
    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


class Blocks(nn.Cell):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.blocks = nn.CellList([nn.Dense(256, 256) for _ in range(4)])

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        if self.kind == "model_output":
            out = Output()
            out["logits"] = x
            out["past"] = ((x, x),)
            return out
        return {"dict": lambda: {"logits": x}, "list": lambda: [x], "nested_tuple": lambda: ((x,), x),
                "namedtuple": lambda: (Pair(x, 1), 2)}[self.kind]()


def first(out):
    if isinstance(out, Output):
        assert out.logits is out["logits"] and isinstance(out["past"][0], tuple)   # type and fields kept
        return out.logits
    return out["logits"] if isinstance(out, dict) else out[0] if isinstance(out, list) else out[0][0]


kind, how = sys.argv[2], sys.argv[3]
net = Blocks(kind)
x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32))
with prefetchd.Daemon(device_budget=700000, store_dir=sys.argv[1]) as d:
    prefetchd.offload(net, d, lookahead=1)
    ref = first(net(x)).asnumpy()
    try:
        if how == "grad":
            ms.value_and_grad(lambda v: first(net(v)).sum(), 0)(x)
        elif how == "vjp":
            ms.vjp(lambda v: first(net(v)), x)[1](ops.ones((4, 256)))
        else:                              # a frozen model: no backward of it runs
            g = ms.grad(lambda v: ops.stop_gradient(first(net(v))).sum() + v.sum(), 0)(x)
            assert np.array_equal(g.asnumpy(), np.ones((4, 256), np.float32))
        print("not refused", flush=True)
    except prefetchd.PrefetchdError as e:
        print("refused:", str(e)[:70], flush=True)
    assert np.array_equal(first(net(x)).asnumpy(), ref)
print("ok", flush=True)
"""


@pytest.mark.parametrize("kind,how", [("dict", "grad"), ("list", "grad"), ("nested_tuple", "grad"),
                                      ("namedtuple", "grad"), ("model_output", "grad"), ("dict", "vjp")])
def test_a_gradient_through_a_nested_output_is_refused(tmp_path, kind, how):
    """MindSpore's backward pre-hook sees a Tensor output or a tuple's own Tensors only; the
    backward of a model returning a dict (mindone's ModelOutput), a list, a nested tuple or a
    namedtuple inside a tuple ran over released weights (SIGSEGV). Their Tensors now pass
    through the refusal too (prefetchd/hooks/backward.py, GradientRefusal)."""
    assert_gradient_refused(run_script(NESTED_OUTPUT, tmp_path, kind, how))


@pytest.mark.parametrize("kind", ["dict", "model_output"])
def test_a_frozen_model_with_a_nested_output_is_not_refused(tmp_path, kind):
    run = run_script(NESTED_OUTPUT, tmp_path, kind, "stop_gradient")
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert run.stdout == "not refused\nok\n", run.stdout


CALLED_ALONE = """
import sys
import numpy as np
import mindspore as ms
from mindspore import nn
import prefetchd
ms.set_device("CPU")
ms.set_seed(3)


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.blocks = nn.CellList([nn.Dense(256, 256) for _ in range(4)])
        self.head = nn.Dense(256, 256)

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


net = Net()
x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32))
ref = net(x).asnumpy()
with prefetchd.Daemon(device_budget=1200000, store_dir=sys.argv[1]) as d:
    prefetchd.offload(net, d, lookahead=1, units=[f"blocks.{i}" for i in range(4)])   # head: the root
    cell = {"first_unit": net.blocks[0], "last_unit": net.blocks[3], "root_cell": net.head}[sys.argv[2]]
    assert np.array_equal(net(x).asnumpy(), ref)
    try:
        ms.grad(lambda v: cell(v).sum(), 0)(x)
        print("not refused", flush=True)
    except prefetchd.PrefetchdError as e:
        print("refused:", str(e)[:70], flush=True)
    assert np.array_equal(cell(x).asnumpy(), cell(x).asnumpy())     # called alone, plainly: still works
    assert np.array_equal(net(x).asnumpy(), ref)
print("ok", flush=True)
"""


@pytest.mark.parametrize("cell", ["first_unit", "last_unit", "root_cell"])
def test_a_gradient_through_one_cell_called_alone_is_refused(tmp_path, cell):
    """A block (unit) or a root cell called alone, outside the model's forward, under a
    gradient: its backward would read weights released after the call (SIGSEGV, or a
    crash in the next forward), and the model's backward pre-hook never saw it. Its output
    now passes through that hook, which refuses."""
    assert_gradient_refused(run_script(CALLED_ALONE, tmp_path, cell))


WEIGHT_INSIDE = """
import sys
import numpy as np
import mindspore as ms
from mindspore import nn
import prefetchd
ms.set_device("CPU")
ms.set_seed(3)


class Net(nn.Cell):                        # returns one of its weights inside a list
    def __init__(self):
        super().__init__()
        self.blocks = nn.CellList([nn.Dense(256, 256) for _ in range(4)])

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return x, [self.blocks[3].weight]


net, other = Net(), Net()
other.update_parameters_name("other.")
x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32))
want = net.blocks[3].weight.asnumpy().copy()
with prefetchd.Daemon(device_budget=1_200_000, store_dir=sys.argv[1]) as d:
    prefetchd.offload(net, d, lookahead=1)
    prefetchd.offload(other, d, lookahead=1)
    weight = net(x)[1][0]              # the guarded weight, or a copy: not a Tensor over its memory
    with d.use(list(other.get_parameters())):                # room for these evicts it
        pass
    try:
        assert np.array_equal(weight.asnumpy(), want)
        print("read", flush=True)
    except prefetchd.NotResidentError:
        print("refused", flush=True)
print("ok", flush=True)
"""


def test_a_weight_returned_inside_a_nested_output_is_never_a_tensor_over_its_memory(tmp_path):
    """Under a gradient the Tensors of the output pass through the backward pre-hook, which
    returns new Tensors over the same memory. A weight the model returns must not be
    swapped for one: read after the weight's eviction, it would kill the process. It is
    the guarded weight (refused) or a copy made before its unit was released (read, equal)."""
    run = run_script(WEIGHT_INSIDE, tmp_path)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    assert run.stdout in ("refused\nok\n", "read\nok\n"), run.stdout


OTHER_OUTPUT = """
import collections
import sys
import numpy as np
import mindspore as ms
from mindspore import nn
import prefetchd
ms.set_device("CPU")
ms.set_seed(2)


class Fields(collections.OrderedDict):     # an output class whose __init__ takes its fields
    def __init__(self, logits):
        super().__init__(logits=logits)


class Plain:                               # not a dataclass, not a container
    def __init__(self, logits):
        self.logits = logits


MAKE = {"defaultdict": lambda x: collections.defaultdict(list, logits=x), "fields": Fields,
        "userdict": lambda x: collections.UserDict(logits=x), "plain": Plain,
        "generator": lambda x: (t for t in [x]), "weight": None}


class Blocks(nn.Cell):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.blocks = nn.CellList([nn.Dense(256, 256) for _ in range(6)])

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return (x, [self.blocks[5].weight]) if self.kind == "weight" else MAKE[self.kind](x)


def first(out):
    if isinstance(out, Plain):
        return out.logits
    if isinstance(out, (dict, collections.UserDict)):
        assert isinstance(out["logits"], ms.Tensor), out["logits"]
        return out["logits"]
    return out[1][0] if isinstance(out, tuple) else next(iter(out))


kind = sys.argv[2]
net = Blocks(kind)
x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32))
ref = first(net(x)).asnumpy()
weight = net.blocks[5].weight
with prefetchd.Daemon(device_budget=int(0.45 * 6 * 263168), store_dir=sys.argv[1]) as d:
    prefetchd.offload(net, d, lookahead=0)
    for _ in range(2):
        out = net(x)
        assert type(out) is type(net.construct(x)) or kind == "generator", type(out)
        if kind != "weight":
            assert np.array_equal(first(out).asnumpy(), ref)
    try:
        if kind == "weight":               # d/dw sum(w): all ones, or refused; never zeros
            g = ms.grad(lambda: first(net(x)).sum(), None, [weight])()[0].asnumpy()
            print("not refused", np.unique(g), flush=True)
        else:
            ms.grad(lambda v: first(net(v)).sum(), 0)(x)
            print("not refused", flush=True)
    except prefetchd.PrefetchdError as e:
        print("refused:", str(e)[:70], flush=True)
    if kind != "weight":
        assert np.array_equal(first(net(x)).asnumpy(), ref)
print("ok", flush=True)
"""


@pytest.mark.parametrize("kind", ["defaultdict", "fields", "userdict", "plain", "generator", "weight"])
def test_outputs_the_walk_does_not_rebuild_still_run_and_their_gradient_is_refused(tmp_path, kind):
    """A defaultdict or an output class whose __init__ takes its fields broke every plain
    forward when the output was rebuilt by calling its class (TypeError, or the generator
    of pairs as the first field); a UserDict, a plain object or a generator hid their
    Tensors from the walk, and the gradient ran over released weights (SIGSEGV). Under a
    gradient each unit's output passes through the refusal too, so how the model's output
    is built no longer matters. weight: the model returns one of its weights, copied when
    the pass ends (a view of the unit's memory); Tensor.copy() is not recorded, so the
    gradient w.r.t. that weight came back all zeros, unrefused."""
    assert_gradient_refused(run_script(OTHER_OUTPUT, tmp_path, kind))


VIEW_IN_CONTAINER = """
import collections
import sys
import numpy as np
import mindspore as ms
from mindspore import nn, Parameter
import prefetchd
ms.set_device("CPU")


class FrozenDict(dict):
    def __setitem__(self, key, value):
        raise TypeError("FrozenDict is immutable")


class TupleSub(tuple):
    pass


class Tagged(collections.namedtuple("Tagged", "logits w")):
    pass


def wrap(h, w):
    if sys.argv[2] == "frozen_dict":
        return FrozenDict({"logits": h, "w": w})
    if sys.argv[2] == "tuple_subclass":
        return TupleSub((h, w))
    out = Tagged(h, w)
    out.meta = "kept"
    return out


class Net(nn.Cell):                        # returns a view of a root weight inside the container
    def __init__(self):
        super().__init__()
        self.blocks = nn.CellList([nn.Dense(256, 256) for _ in range(6)])
        self.emb = Parameter(ms.Tensor(np.ones((4, 256), np.float32)), name="emb")

    def construct(self, x):
        h = x + self.emb[0]
        for block in self.blocks:
            h = block(h)
        return wrap(h, self.emb.reshape(-1))


ms.set_seed(1)
net = Net()
x = ms.Tensor(np.ones((4, 256), np.float32))
ref = net(x)
with prefetchd.Daemon(device_budget=int(0.45 * sum(p.nbytes for p in net.get_parameters())),
                      store_dir=sys.argv[1]) as d:
    handle = prefetchd.offload(net, d, lookahead=1)
    for _ in range(3):
        out = net(x)
        assert type(out) is type(ref) and getattr(out, "meta", None) == getattr(ref, "meta", None)
        w = out["w"] if isinstance(out, dict) else out[1]
        assert np.array_equal(w.asnumpy(), ref["w" if isinstance(ref, dict) else 1].asnumpy())
    handle.close()                         # the weights are given back: the copy must not be a view
    assert float(w.asnumpy().sum()) == 1024.0
print("ok", flush=True)
"""


@pytest.mark.parametrize("kind", ["frozen_dict", "tuple_subclass", "namedtuple_subclass"])
def test_a_view_of_a_weight_inside_an_unusual_container_is_copied_and_the_container_kept(tmp_path, kind):
    """The copy of a weight's view rebuilds the container around it: a mapping refusing
    __setitem__ failed every forward (TypeError), a tuple subclass kept the view (SIGSEGV when
    read after the weight left), a namedtuple subclass lost its instance attributes."""
    run = run_script(VIEW_IN_CONTAINER, tmp_path, kind)
    assert run.returncode == 0 and run.stdout == "ok\n", (run.returncode, run.stdout, run.stderr[-2000:])


UNSEEN_UNIT_OUTPUT = """
import collections
import sys
import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter
import prefetchd
ms.set_device("CPU")


class Out:                                 # a plain object: the output walk does not enter it
    def __init__(self, h):
        self.h = h


class Block(nn.Cell):                      # owns its weight: no sub-cell output passes the refusal
    def __init__(self, i):
        super().__init__()
        self.w = Parameter(ms.Tensor(np.full((256, 256), 0.01 * (i + 1), np.float32)), name=f"w{i}")

    def construct(self, x):
        y = ops.matmul(x, self.w)
        return collections.UserDict(h=y) if sys.argv[2] == "userdict" else Out(y)


class Net(nn.Cell):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.CellList([Block(i) for i in range(blocks)])

    def construct(self, x):
        for block in self.blocks:
            x = block(x)["h"] if sys.argv[2] == "userdict" else block(x).h
        return Out(x)


net = Net(1 if sys.argv[3] == "all_root" else 6)
x = ms.Tensor(np.ones((2, 256), np.float32))
ref = net(x).h.asnumpy()
budget = sum(p.nbytes for p in net.get_parameters()) * (2 if sys.argv[3] == "all_root" else 0.45)
with prefetchd.Daemon(device_budget=int(budget), store_dir=sys.argv[1]) as d:
    prefetchd.offload(net, d, lookahead=1)
    assert np.array_equal(net(x).h.asnumpy(), ref)
    try:
        ms.grad(lambda v: net(v).h.sum())(x)
        print("not refused", flush=True)
    except prefetchd.PrefetchdError as e:
        print("refused:", str(e)[:70], flush=True)
    assert np.array_equal(net(x).h.asnumpy(), ref)
    g = ms.grad(lambda v: (v * v).sum())(x)            # PyNative recovered: another gradient works
    assert np.array_equal(g.asnumpy(), 2 * x.asnumpy())
print("ok", flush=True)
"""


@pytest.mark.parametrize("kind,units", [("plain", "units"), ("userdict", "units"), ("plain", "all_root")])
def test_a_gradient_through_outputs_with_no_visible_tensor_is_refused_in_the_forward(tmp_path, kind, units):
    """Blocks that return a plain object or a UserDict, and a model that returns one too:
    no Tensor of theirs could pass through the refusal, so the backward ran over released
    weights (SIGSEGV); an all-root model (no units) was not refused at all. A recorded
    forward whose unit or model output has nothing to pass is refused there and then."""
    assert_gradient_refused(run_script(UNSEEN_UNIT_OUTPUT, tmp_path, kind, units))


KEPT_CONTAINER = """
import sys
import numpy as np
import mindspore as ms
from mindspore import nn
import prefetchd
ms.set_device("CPU")


class Pair(tuple):                         # its class cannot be called with the items
    def __new__(cls, first, second):
        return super().__new__(cls, (first, second))


class Net(nn.Cell):                        # its own weight: all root, no unit
    def __init__(self):
        super().__init__()
        self.w = ms.Parameter(ms.Tensor(np.full((256, 256), 0.01, np.float32)), name="w")

    def construct(self, x):
        x = ms.ops.matmul(x, self.w)
        return Pair(x, x * 2)


net = Net()
x = ms.Tensor(np.ones((4, 256), np.float32))
ref = net(x)[1].asnumpy()
with prefetchd.Daemon(device_budget=800_000, store_dir=sys.argv[1]) as d:     # (3x the weights)
    prefetchd.offload(net, d, lookahead=1)
    out = net(x)
    assert type(out) is Pair and np.array_equal(out[1].asnumpy(), ref)
    try:
        ms.grad(lambda v: net(v)[1].sum())(x)
        print("not refused", flush=True)
    except prefetchd.PrefetchdError as e:
        print("refused:", str(e)[:70], flush=True)
    assert np.array_equal(net(x)[1].asnumpy(), ref)
print("ok", flush=True)
"""


def test_an_output_kept_as_it_was_is_not_taken_as_watched(tmp_path):
    """A container the rebuild keeps as it was holds none of the Tensors that passed
    through the refusal: the forward is refused rather than taken as watched (for a model
    with no units, its output is the only place a gradient is seen)."""
    assert_gradient_refused(run_script(KEPT_CONTAINER, tmp_path))


MISSED_READ = """
import sys
import numpy as np, mindspore as ms
from mindspore import nn, ops, Tensor
import prefetchd
ms.set_device("CPU")
D = 192
class M(nn.Cell):
    def __init__(self):
        super().__init__()
        self.blocks = nn.CellList([nn.Dense(D, D) for _ in range(10)])
    def construct(self, x):
        for b in self.blocks:
            x = ops.tanh(b(x))
        for name, c in self.cells_and_names():     # a read the planner does not follow
            if name == "blocks.3":
                x = x + ops.matmul(x, c.weight)
        return x
class Metric(nn.Cell):                              # a cell of the user's, not offloaded
    def __init__(self, w):
        super().__init__()
        self.w = w
    def construct(self, x):
        return ops.matmul(x, self.w)
m = M()
x = Tensor(np.ones((2, D), np.float32))
with prefetchd.Daemon(device_budget="600KiB", store_dir=sys.argv[1]) as d:
    prefetchd.offload(m, d, lookahead=2)
    try:
        m(x)
    except prefetchd.NotResidentError as e:
        print("refused:", e)
    try:
        Metric(m.blocks[5].weight)(x)
    except prefetchd.NotResidentError as e:
        print("outside:", e)
"""


def test_a_read_the_planner_missed_inside_a_forward_is_refused_saying_so(tmp_path):
    # The refusal said "outside an offloaded model's forward, use daemon.use": the read was
    # inside the forward, and daemon.use was no remedy (an outside probe).
    run = run_script(MISSED_READ, tmp_path)
    assert run.returncode == 0, (run.returncode, run.stdout, run.stderr[-2000:])
    line = refusal(run)
    assert line is not None and "tensor 'blocks.3.weight' is not pinned for this read" in line, run.stdout
    assert "the read is inside the offloaded model's forward, where offload() did not see it" in line, line
    assert "daemon.use" not in line and "outside an offloaded model's forward" not in line, line
    # A cell of the user's reading a managed weight is outside the model: daemon.use is the remedy.
    outside = next(l for l in run.stdout.splitlines() if l.startswith("outside: "))
    assert "daemon.use([...])" in outside and "did not see it" not in outside, outside
