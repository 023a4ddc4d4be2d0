"""Servables the serving tests run in real worker processes (--model tests' module:function)."""
import time

import numpy as np

from prefetchd.serve import TensorSpec

MAX_SLEEP = 30.0


class Sleepy:
    """forward(x) sleeps x[0, 0] seconds (at most MAX_SLEEP), then runs a Dense layer:
    a request that is as slow as it asks to be, for timeouts, deaths and hangs."""

    def __init__(self, seed):
        import mindspore as ms
        from mindspore import nn
        self.cell = nn.Dense(4, 4)
        rng = np.random.default_rng(seed)
        for p in self.cell.get_parameters():
            p.set_data(ms.Tensor(rng.standard_normal(p.shape).astype(np.float32)))
        self.inputs = [TensorSpec((None, 4), "float32", 0, "x")]

    def forward(self, x):
        import mindspore as ms
        if x.size and x[0, 0] > 0:
            time.sleep(min(float(x[0, 0]), MAX_SLEEP))
        return self.cell(ms.Tensor(x))


def sleepy(seed=0):
    return Sleepy(seed)


TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)


def tiny_llama(seed=0):
    """A tiny random-init mindone LlamaForCausalLM (mindone 0.5), weights seeded like
    prefetchd.serve.tiny_lm's (norms left at one): served through the HF-style adapter."""
    import mindspore as ms
    from mindone.transformers import LlamaForCausalLM
    from transformers import LlamaConfig
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
    model.set_train(False)
    rng = np.random.default_rng(seed)
    for p in model.get_parameters():
        if "norm" not in p.name:
            p.set_data(ms.Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    return model


def hf_style_lm(seed=0):
    """prefetchd.serve.tiny_lm's model behind transformers' interface, as a Cell of our
    own: `model(input_ids)` returns an output object with `.logits` (not a tuple), and
    `generate(input_ids, max_new_tokens=N, do_sample=False)` the prompt + N new ids."""
    from types import SimpleNamespace

    from mindspore import nn

    from prefetchd.serve.tiny_lm import build

    class HFStyleLM(nn.Cell):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.config = inner.config

        def construct(self, input_ids):
            logits, _ = self.inner(input_ids)
            return SimpleNamespace(logits=logits)          # CausalLMOutputWithPast-like

        def generate(self, input_ids, max_new_tokens=16, do_sample=False):
            # Greedy through the model's own forward (no cache), as transformers' generate
            # runs: the offloaded cell is the one called (its parts alone are refused).
            import mindspore as ms
            assert not do_sample
            ids = input_ids.asnumpy()
            for _ in range(max_new_tokens):
                logits = self(ms.Tensor(ids)).logits[:, -1, :].asnumpy()
                ids = np.concatenate([ids, logits.argmax(-1).astype(ids.dtype)[:, None]], axis=1)
            return ms.Tensor(ids)

    return HFStyleLM(build(seed=seed))


def slow_to_build(seed=0):
    """A factory that takes a minute to build: a server stopped while its workers start."""
    time.sleep(60)
    return Sleepy(seed)


def raises(seed=0):
    """A factory that fails: the server says why in one line."""
    raise RuntimeError(f"factory of seed {seed} failed on purpose")


def broken_but_the_first(seed=0):
    """Sleepy for the first worker to build it; the others fail while the file named by
    $PFD_TEST_BROKEN exists (a cause that passes: a model file put back, a disk cleaned)."""
    import os
    flag = os.environ["PFD_TEST_BROKEN"]
    try:
        os.close(os.open(flag + ".first", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        if os.path.exists(flag):
            raise RuntimeError(f"{flag} is there: failing on purpose") from None
    return Sleepy(seed)


def exits(seed=0):
    """A factory that calls sys.exit (argparse in a model library does): not an Exception."""
    import sys
    sys.exit(f"no such checkpoint for seed {seed}")


def sleepy_front(store_dir, endpoint, name, **options):
    """A started in-process prefetchd.serve.Front of one worker serving `sleepy`, one
    request per batch (the tests' front for queueing, timeouts and connections)."""
    from prefetchd.serve import Front, ServeSpec
    spec = ServeSpec(models=1, model="tests.serve._servables:sleepy", model_bytes_hint=80,
                     budget=1 << 20, store_dir=str(store_dir))
    options = {"request_timeout": 60.0, **options}
    return Front(endpoint, workers=1, spec=spec, name=name, max_batch_size=1, max_queue_delay_ms=1,
                 **options).start()


def wide(seed=0):
    """One nn.Dense(2048, 4096): 32 MiB of weights, above the demo model's 19 MiB default
    budget that a custom model's default used to be."""
    import mindspore as ms
    from mindspore import nn
    ms.set_seed(seed)
    return nn.Dense(2048, 4096), [TensorSpec((None, 2048), "float32", 0, "x")]


def many_small(seed=0):
    """24 nn.Dense(4, 4): 48 tensors of 64 and 16 bytes, 1920 bytes in all, each of which
    the device tier holds in a page of its own."""
    import mindspore as ms
    from mindspore import nn
    ms.set_seed(seed)
    return nn.SequentialCell([nn.Dense(4, 4) for _ in range(24)]), [TensorSpec((None, 4), "float32", 0, "x")]


def one_scalar(seed=0):
    """A model of one 0-d weight: 4 bytes, 150% of which is under any budget a daemon takes."""
    import mindspore as ms
    from mindspore import nn

    class Scale(nn.Cell):
        def __init__(self):
            super().__init__()
            self.k = ms.Parameter(ms.Tensor(np.float32(1.5 + seed)), name="k")

        def construct(self, x):
            return x * self.k
    return Scale(), [TensorSpec((None, 4), "float32", 0, "x")]
