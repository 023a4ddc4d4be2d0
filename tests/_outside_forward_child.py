"""Child of tests/hooks/test_outside_forward.py: one thing a user does with an offloaded model's
weights outside its forward. A regression dies here with SIGSEGV (a native read of an
unmapped home), not in the test process.

    python _outside_forward_child.py CASE STORE_DIR

A small model (4 x nn.Dense(256, 256) in a CellList, budget ~2.6 blocks, lookahead 1)
runs two forwards in PyNative, then CASE acts on a weight that is not resident.
Prints "refused: <error class>: <message>" when the action raised, then checks that the
model still gives the resident model's answer and prints "ok".
"""
import collections
import copy
import os
import pickle
import sys

import numpy as np

import mindspore as ms
from mindspore import nn, ops
from mindspore._c_expression import TensorPy

import prefetchd

CASE, STORE = sys.argv[1], sys.argv[2]
H = 256
ms.set_device("CPU")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.blocks = nn.CellList([nn.Dense(H, H) for _ in range(4)])

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@ms.jit
def doubled(w):
    return w * 2


def absent_weight(daemon, net):
    """A weight that is not resident, and stays so: blocks.2's, evicted. (The first absent one
    was blocks.0's, which the end of a pass prefetches for the next: under load it became
    resident while the case acted on it, and a read that must fault did not.)"""
    w = net.blocks[2].weight
    daemon.evict([w]).result(30)
    state = {t["name"]: t["state"] for t in daemon.tensors()}[w.name]
    if state != "absent":
        raise SystemExit(f"{w.name} is {state} after its eviction")
    return w


def act(case, d, net, w, x, ckpt):
    """The action; returns nothing, raises what prefetchd (or MindSpore) raises."""
    if case == "save_checkpoint":
        ms.save_checkpoint(net, ckpt)
    elif case == "save_checkpoint_list":
        ms.save_checkpoint([{"name": w.name, "data": w}], ckpt)
    elif case == "assign":                       # a KV-cache reset, a weight update
        ops.assign(w, ms.Tensor(np.zeros((H, H), np.float32)))
        ms.hal.synchronize()
    elif case == "norm":
        ops.norm(w).asnumpy()
    elif case == "method":
        w.norm().asnumpy()
    elif case == "operator":
        (w * 2).asnumpy()
    elif case == "second_argument":
        ops.matmul(x, w).asnumpy()
    elif case == "jit_argument":
        doubled(w).asnumpy()
    elif case == "pickle":
        pickle.dumps(w)
    elif case == "deepcopy":
        copy.deepcopy(net)
    elif case == "data":
        w.data.asnumpy()
    # Refused by the model's backward pre-hook (prefetchd/hooks/backward.py).
    elif case == "grad_input":
        ms.grad(net, grad_position=0)(x).asnumpy()
    elif case == "grad_weights":
        ms.grad(net, grad_position=None, weights=net.trainable_params())(x)
    elif case == "value_and_grad":
        ms.value_and_grad(net, grad_position=0)(x)
    elif case == "grad_of_loss":                 # the model inside a loss: its backward comes later
        ms.grad(lambda v: (net(v) * net(v)).sum(), grad_position=0)(x)
    elif case == "vjp":                          # its forward does not say it is recorded for a gradient
        ms.vjp(net, x)[1](ms.ops.ones_like(x))
    elif case == "grad_operation":
        ms.ops.GradOperation()(net)(x)
    elif case == "frozen_backbone":              # no backward of the model runs: not refused
        head = nn.Dense(H, 1)
        loss, grads = ms.value_and_grad(lambda v: head(ops.stop_gradient(net(v))).sum(), None,
                                        head.trainable_params())(x)
        want = float(head(ms.Tensor(act.resident_output)).sum().asnumpy())
        assert np.isclose(float(loss.asnumpy()), want, rtol=1e-5), (float(loss.asnumpy()), want)
        assert all(g.shape == p.shape for g, p in zip(grads, head.trainable_params()))
        print("frozen backbone: head gradients computed")
    elif case == "stack":                        # a legacy Primitive with a sequence argument
        ops.stack((w, w)).asnumpy()
    elif case == "stack_namedtuple":             # a tuple's subclass
        ops.stack(collections.namedtuple("Pair", "a b")(w, w)).asnumpy()
    elif case == "addn":
        ops.addn([w, x[:1].broadcast_to((H, H))]).asnumpy()
    elif case == "tensor_alias":
        ms.Tensor(w).asnumpy()
    # A base class's method, called directly past the guard subclass.
    elif case == "base_method":
        float(ms.Tensor.asnumpy(w).sum())
    elif case == "parameter_base_method":
        float(ms.Parameter.asnumpy(w).sum())
    elif case == "base_item":
        ms.Tensor.item(w)
    elif case == "native_getitem":               # MindSpore's native class's own
        TensorPy.__getitem__(w, 0).asnumpy()
    elif case == "native_op":
        TensorPy.sum(w).asnumpy()
    # Not covered (docs/daemon-api.md): the process dies, saying why first.
    elif case == "native_repr":
        print(TensorPy.__repr__(w)[:10])
    else:
        raise SystemExit(f"unknown case {case!r}")


def use_case(d, net, x, ref, ckpt):
    """Inside daemon.use the same actions work, give the resident values, and writes are kept."""
    w1, w2 = net.blocks[1].weight, net.blocks[2].weight
    some = [p for p in net.get_parameters() if p.name.startswith(("blocks.1.", "blocks.2."))]
    with d.use(some):
        assert np.isclose(float(ops.norm(w1).asnumpy()), np.linalg.norm(ref[w1.name]), rtol=1e-5)
        assert np.array_equal((w2 * 2).asnumpy(), ref[w2.name] * 2)
        assert np.array_equal(doubled(w2).asnumpy(), ref[w2.name] * 2)
        ms.save_checkpoint([{"name": p.name, "data": p} for p in some], ckpt)
    loaded = ms.load_checkpoint(ckpt)
    assert all(np.array_equal(loaded[p.name].asnumpy(), ref[p.name]) for p in some), "checkpoint values"
    print("use: norm, ops, jit and save_checkpoint give the resident values")
    # A kernel's write inside use (docs/stable-addresses.md, "Writes by compute") is kept
    # through an eviction: written back, not dropped as clean.
    with d.use([w1]):
        ops.assign(w1, ms.Tensor(np.full((H, H), 0.5, np.float32)))
        ms.hal.synchronize()
    d.evict([w1]).result(30)
    assert d.handle(w1.name).state.value == "absent"
    with d.use([w1]):
        assert np.all(w1.asnumpy() == 0.5), "ops.assign inside use was lost at eviction"
        w1.set_data(ms.Tensor(ref[w1.name]))   # a Python-level write: marks it dirty too
    d.evict([w1]).result(30)
    with d.use([w1]):
        assert np.array_equal(w1.asnumpy(), ref[w1.name]), "set_data inside use was lost at eviction"
    print("use: ops.assign and set_data are kept through an eviction")
    # Arrays taken inside use outlive it: MindSpore's asnumpy on CPU is a view of the tensor's
    # memory, which is unmapped once the weight is evicted (the process died reading it).
    with d.use([w2]):
        kept = [w2.asnumpy(), w2.numpy(), np.asarray(w2)]
    d.evict([w2]).result(30)
    for _ in range(2):
        net(x)
    assert all(np.array_equal(a, ref[w2.name]) for a in kept), "an array taken inside use changed"
    print("use: arrays taken inside use stay readable after the weight is evicted")


def main():
    rng = np.random.default_rng(0)
    net = Net()
    for p in net.get_parameters():
        p.set_data(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32) * 0.05))
    x = ms.Tensor(rng.standard_normal((4, H)).astype(np.float32))
    ref = {p.name: p.asnumpy().copy() for p in net.get_parameters()}
    ref_out = act.resident_output = net(x).asnumpy()
    ckpt = os.path.join(STORE, "out.ckpt")
    with prefetchd.Daemon(device_budget=700000, store_dir=os.path.join(STORE, "store")) as d:
        prefetchd.offload(net, d, lookahead=1)
        for _ in range(2):
            assert np.allclose(net(x).asnumpy(), ref_out, atol=1e-5)
        if CASE == "use":
            use_case(d, net, x, ref, ckpt)
        else:
            w = absent_weight(d, net)
            print(f"acting on {w.name}", flush=True)
            try:
                act(CASE, d, net, w, x, ckpt)
                print("no error", flush=True)
            except Exception as e:   # noqa: BLE001 - the test judges the class and message
                print(f"refused: {type(e).__name__}: {e}", flush=True)
        # Nothing was written, nothing broke: the model still gives the resident answer.
        for _ in range(2):
            out = net(x).asnumpy()
            assert np.allclose(out, ref_out, atol=1e-5), float(np.abs(out - ref_out).max())
        with d.use([p for p in net.get_parameters() if p.name.startswith("blocks.1.")]):
            assert np.array_equal(net.blocks[1].weight.asnumpy(), ref["blocks.1.weight"])
    print("ok")


if __name__ == "__main__":
    main()
