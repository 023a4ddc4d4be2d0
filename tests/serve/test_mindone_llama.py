"""mindone's LlamaForCausalLM (tiny, random init) served through the HF-style adapter
(prefetchd.serve.causal_lm) in a real worker, offloaded: its tokens equal its own
`generate` run resident. Skipped, with the reason, where mindone is not installed or
its model cannot run on this MindSpore backend (2.10's CPU backend has no kernels for
the `mint` ops mindone's Llama uses: "The kernel Embedding unregistered")."""
import os
import secrets

import numpy as np
import pytest

pytest.importorskip("mindone", reason="mindone is not installed (pip install mindone==0.5.0)")

from prefetchd.serve import Client, Front, ServeSpec  # noqa: E402

from _servables import tiny_llama  # noqa: E402


def _ids(seed, batch, prompt):
    return np.random.default_rng(seed).integers(0, 64, (batch, prompt)).astype(np.int64)


# Tried in a child first: a failed op MindSpore ran asynchronously (the rotary embedding's
# Arange, while the model builds) is reported at a later synchronization, which in this
# process was another test module's ("The kernel Arange unregistered" in a CI dry run).
RUNS_HERE = """
import sys
import numpy as np
import mindspore as ms
from _servables import tiny_llama
try:
    tiny_llama(seed=0)(ms.Tensor(np.zeros((1, 3), np.int64)))
    ms.runtime.synchronize()
except RuntimeError as e:
    sys.exit(str(e).strip().splitlines()[0])
"""


@pytest.fixture(scope="module")
def resident():
    import subprocess
    import sys

    import mindspore as ms
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), *sys.path]))
    tried = subprocess.run([sys.executable, "-c", RUNS_HERE], capture_output=True, text=True, env=env,
                           timeout=600)
    if tried.returncode != 0:
        why = tried.stderr.strip().splitlines()[-1] if tried.stderr.strip() else f"exit {tried.returncode}"
        if "unregistered" not in why:
            raise AssertionError(f"building mindone's LlamaForCausalLM failed: {tried.stderr[-2000:]}")
        pytest.skip(f"mindone's LlamaForCausalLM cannot run on this backend: {why}")
    model = tiny_llama(seed=0)
    model(ms.Tensor(_ids(0, 1, 3)))
    return model


def test_mindone_llama_generates_its_own_tokens_offloaded(resident, tmp_path):
    import mindspore as ms
    nbytes = sum(p.size * 4 for p in resident.get_parameters())
    spec = ServeSpec(models=1, model="_servables:tiny_llama", model_bytes_hint=nbytes,
                     budget=int(nbytes * 0.75), lookahead=1, store_dir=str(tmp_path))
    ids = _ids(1, 2, 5)
    want = resident.generate(ms.Tensor(ids), max_new_tokens=6, do_sample=False).asnumpy()
    with Front(f"ipc://llama-{os.getpid()}-{secrets.token_hex(2)}.sock", workers=1, spec=spec,
               request_timeout=120.0, name=f"llama{os.getpid()}").start() as front:
        with Client(front.endpoint, timeout=120) as c:
            got = c.generate("m0", ids, max_new_tokens=6)
            (logits,) = c.infer("m0", ids)
    assert np.array_equal(got, want[:, ids.shape[1]:])
    np.testing.assert_allclose(logits, resident(ms.Tensor(ids)).logits.asnumpy(),
                               rtol=1e-5, atol=1e-5)
