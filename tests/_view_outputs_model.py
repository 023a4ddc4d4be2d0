"""Child of tests/hooks/test_view_outputs.py: a model whose cells return views of their own
weights, streamed through a small budget; prints one line per pass (max abs error
against the resident model) and 'ok'. A regression dies here with SIGSEGV (a read of
an unmapped home), not in the test process."""
import dataclasses
import sys
import tempfile
import types

import numpy as np

import mindspore as ms
import prefetchd

KIND, STORE = sys.argv[1], sys.argv[2]
H = 512
nn = ms.nn


class Table(nn.Cell):
    """A learned table, returned (or a view of it) rather than used."""
    def __init__(self):
        super().__init__()
        self.pe = ms.Parameter(ms.Tensor(np.random.default_rng(1).standard_normal((64, H)).astype(np.float32)))
        self.proj = nn.Dense(H, H)

    def construct(self, x):
        n = x.shape[0]
        if KIND in ("slice", "part"):
            return self.pe[:n]
        if KIND == "offset_slice":
            return self.pe[8:8 + n]
        if KIND == "transpose":
            return self.pe.T[:, :n].T
        if KIND == "reshape":
            return self.pe.reshape(64, 8, H // 8)[:n].reshape(n, H)
        if KIND == "itself":
            return self.pe
        if KIND == "tuple":
            return self.proj(x), (self.pe[:n],)
        if KIND == "dataclass":              # a model-output class
            return Output(self.proj(x), self.pe[:n])
        if KIND == "namespace":
            return types.SimpleNamespace(hidden=self.proj(x), table=self.pe[:n])
        if KIND == "cycle":                  # a parent pointer: the output refers to itself
            out = types.SimpleNamespace(hidden=self.proj(x), table=self.pe[:n])
            out.me = [out]
            return out
        return self.proj(x)


@dataclasses.dataclass(frozen=True)
class Output:
    hidden: object
    table: object


class Holder(nn.Cell):
    """Its parts are called, never it (prefetchd.hooks.parts)."""
    def __init__(self):
        super().__init__()
        self.table = Table()

    def construct(self, x):
        raise RuntimeError("never called")


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.blocks = nn.CellList([Holder() if KIND == "part" else Table() for _ in range(6)])
        self.pos = ms.Parameter(ms.Tensor(np.ones((64, H), np.float32)))

    def construct(self, x):
        n, outs = x.shape[0], []
        for block in self.blocks:
            if KIND == "part":
                out = block.table(x)
            else:
                out = block(x)
            if KIND == "tuple":
                out = out[0] + out[1][0]
            if KIND == "itself":
                out = out[:n]
            outs.append(out)
        acc = x
        for out in outs:                  # read after the later blocks evicted the first ones
            acc = acc + (out.hidden + out.me[0].table if KIND == "cycle" else
                         out.hidden + out.table if KIND in ("dataclass", "namespace") else out)
        if KIND == "root":
            return acc, self.pos[:n]      # a view of a root weight leaves the model
        return acc


def values(out):
    return np.concatenate([o.asnumpy().ravel() for o in (out if isinstance(out, tuple) else (out,))])


ms.set_context(mode=ms.PYNATIVE_MODE)
net = Net()
x = ms.Tensor(np.random.default_rng(2).standard_normal((16, H)).astype(np.float32))
expected = values(net(x))
block_bytes = (64 * H + H * H + H) * 4
with prefetchd.Daemon(device_budget=4 * block_bytes, store_dir=STORE) as daemon:
    handle = prefetchd.offload(net, daemon, lookahead=1)
    assert len(handle.plan().units) == 6, handle.plan().format_table()
    for i in range(3):
        error = float(np.abs(values(net(x)) - expected).max())
        print("pass", i, error, flush=True)
        assert error == 0.0
    kept = net(x)
    print("misses", handle.stats()["misses"])
    # Every device replica dropped (the root's too): the kept output must not be one.
    daemon.evict(list(net.get_parameters())).result(timeout=60)
    error = float(np.abs(values(kept) - expected).max())
    print("after evict", error)
    assert error == 0.0
# The daemon is closed and its tiers are gone: an output must still be the caller's.
error = float(np.abs(values(kept) - expected).max())
print("after close", error)
assert error == 0.0
print("ok")
