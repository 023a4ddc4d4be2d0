"""A test-side shim for mindone models on MindSpore 2.10's CPU backend (import as
`from _cpu_mint import patch_cpu_mint`): some `mint` ops its models call have no CPU kernel
there ("The kernel Addmm unregistered"). Never used by prefetchd itself."""
import numpy as np


def patch_cpu_mint(ms, monkeypatch):
    """Swap (through `monkeypatch`, undone after the test) the mint ops that MindSpore 2.10's
    CPU backend has no kernel for with ops kernels computing the same thing."""
    from mindspore import mint, ops

    def addmm(input, mat1, mat2, *, beta=1, alpha=1):
        return beta * input + alpha * ops.matmul(mat1, mat2)

    def arange(start=0, end=None, step=1, *, dtype=None):
        return ops.arange(start, end, step, dtype=dtype)

    def embedding_construct(self, input):            # max_norm=None in these configs
        return ops.gather(self.weight, input, 0)

    def topk(input, k, dim=-1, largest=True, sorted=True):
        return ops.topk(input, k, dim=dim, largest=largest, sorted=sorted)

    def layer_norm_construct(self, input):           # over the last axis, as these configs use it
        norm = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=self.eps)
        return norm(input, self.weight, self.bias)[0]

    def clone(self):
        return self.copy()
    def gelu(input, approximate="none"):
        return ops.gelu(input, approximate=approximate)

    def one_hot(tensor, num_classes=-1):
        one, zero = ms.Tensor(1, tensor.dtype), ms.Tensor(0, tensor.dtype)
        return ops.one_hot(tensor, num_classes, one, zero)
    monkeypatch.setattr(mint.nn.functional, "gelu", gelu)
    monkeypatch.setattr(mint.nn.functional, "one_hot", one_hot)
    where = mint.where

    def where_or_nonzero(condition, input=None, other=None):
        if input is None and other is None:          # mint.where(cond): the indices, as nonzero
            return tuple(ms.Tensor(i.astype(np.int64)) for i in np.nonzero(condition.asnumpy()))
        return where(condition, input, other)
    def index_add_(self, dim, index, source, *, alpha=1):   # Mixtral's expert combine, dim 0
        assert dim == 0 and alpha == 1
        values = self.asnumpy().copy()
        np.add.at(values, index.asnumpy(), source.asnumpy())
        self.assign_value(ms.Tensor(values))
        return self
    monkeypatch.setattr(ms.Tensor, "index_add_", index_add_)
    monkeypatch.setattr(mint, "where", where_or_nonzero)
    monkeypatch.setattr(mint, "topk", topk)
    monkeypatch.setattr(mint.nn.LayerNorm, "construct", layer_norm_construct)
    monkeypatch.setattr(ms.Tensor, "clone", clone)
    monkeypatch.setattr(mint, "addmm", addmm)
    monkeypatch.setattr(mint, "arange", arange)
    monkeypatch.setattr(mint.nn.Embedding, "construct", embedding_construct)
