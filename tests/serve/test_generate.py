"""Generation through `prefetchd serve`: a small causal LM of our own
(prefetchd.serve.tiny_lm, KV cache, greedy) served offloaded (its budget below its
weights) through the HF-style adapter, in real worker processes. The tokens equal
the model's own `generate` run resident; requests that arrive together share
decode steps; a servable object (not a cell) is served too, and so is a cell with
transformers' interface (`.logits` outputs)."""
import os
import secrets

import numpy as np
import pytest

from prefetchd.control import ServiceError
from prefetchd.serve import Client, Front, ServeSpec
from prefetchd.serve.causal_lm import CausalLMServable
from prefetchd.serve.tiny_lm import build

LM_BYTES = 126464              # tiny_lm.build()'s parameters, float32
BUDGET = 90000                 # under LM_BYTES: the weights stream


@pytest.fixture(scope="module")
def front(tmp_path_factory):
    spec = ServeSpec(models=1, model="prefetchd.serve.tiny_lm:build", budget=BUDGET, lookahead=1,
                     store_dir=str(tmp_path_factory.mktemp("lm-store")))
    f = Front(f"ipc://gen-{os.getpid()}-{secrets.token_hex(2)}.sock", workers=1, spec=spec,
              request_timeout=60.0, name=f"gen{os.getpid()}", max_batch_size=8,
              max_queue_delay_ms=150).start()
    yield f
    f.close(10)


@pytest.fixture(scope="module")
def resident():
    model = build(seed=0)                 # what the worker builds for m0 (spec.seed + 0)
    assert sum(p.size * 4 for p in model.get_parameters()) == LM_BYTES > BUDGET
    return model


@pytest.fixture
def client(front):
    with Client(front.endpoint, timeout=60) as c:
        yield c


def _ids(seed, batch, prompt):
    return np.random.default_rng(seed).integers(0, 64, (batch, prompt)).astype(np.int64)


def _own_generate(model, ids, n):
    import mindspore as ms
    out = model.generate(ms.Tensor(ids), max_new_tokens=n, do_sample=False).asnumpy()
    assert np.array_equal(out[:, :ids.shape[1]], ids)
    return out[:, ids.shape[1]:]


def test_generate_returns_the_models_own_greedy_tokens(client, resident, front):
    ids = _ids(1, 2, 5)
    got = client.generate("m0", ids, max_new_tokens=7)
    assert got.dtype == np.int64 and got.shape == (2, 7)
    assert np.array_equal(got, _own_generate(resident, ids, 7))
    status = client_status(front)
    assert status["device"]["capacity"] < LM_BYTES              # it really streamed


def client_status(front):
    from prefetchd.control import Client as ControlClient
    with ControlClient(front.endpoint, timeout=20) as c:
        return c.status()["workers"][0]["daemon"]


def test_generation_requests_that_arrive_together_share_decode_steps(client, resident):
    """A model's first three joined generates are also run prompt by prompt (checked: the
    rows are the clients' own, prefetchd.serve.execute); after them, one generate serves all."""
    joined = 0
    for round_ in range(10):
        prompts = [_ids(10 * round_ + i, 1, 4) for i in range(4)]
        futures = [client.submit_generate("m0", p, max_new_tokens=5) for p in prompts]
        outs = [f.result(120) for f in futures]
        for p, got in zip(prompts, outs):
            assert np.array_equal(got, _own_generate(resident, p, 5))
        joined += max(f.reply["batch_size"] for f in futures) > 1
        if joined == 2:
            break
    assert joined == 2                 # (10 rounds: a round's requests could miss one batch window)


def test_infer_on_the_lm_returns_its_logits(client, resident):
    import mindspore as ms
    ids = _ids(3, 2, 6)
    (logits,) = client.infer("m0", ids)
    want = resident(ms.Tensor(ids))[0].asnumpy()
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def test_generation_refusals(client):
    with pytest.raises(ServiceError, match=r"ids must be in \[0, 64\)"):
        client.generate("m0", np.array([[1, 64]], np.int64), max_new_tokens=2)
    with pytest.raises(ServiceError, match="dtype float32, the model takes int64"):
        client.generate("m0", np.zeros((1, 3), np.float32), max_new_tokens=2)
    with pytest.raises(ServiceError, match="^BAD_REQUEST: generate: a prompt of 60 tokens plus max_new_tokens=10 "
                                           "is over the model's 64 positions"):   # (the worker's refusal)
        client.generate("m0", _ids(0, 1, 60), max_new_tokens=10)
    with pytest.raises(ServiceError, match="max_new_tokens"):
        client.generate("m0", _ids(0, 1, 3), max_new_tokens=0)
    with pytest.raises(ServiceError, match=r"BAD_REQUEST.*\[2, 0\] is empty: generate needs a prompt"):
        client.generate("m0", np.zeros((2, 0), np.int64), max_new_tokens=2)   # was INTERNAL
    with pytest.raises(ServiceError, match=r"BAD_REQUEST.*\[0, 4\] has no rows: an empty batch"):
        client.generate("m0", np.zeros((0, 4), np.int64), max_new_tokens=2)
    assert client.generate("m0", _ids(0, 1, 3), max_new_tokens=2).shape == (1, 2)


def test_a_generate_may_use_every_position_the_last_new_token_is_not_fed(client, resident):
    # 3 + 62 was refused "over the model's 64 positions", though a greedy generate feeds the
    # prompt and 61 new ids (positions 0..63) and returns the 62nd; 3 + 63 needs 65.
    ids = _ids(5, 1, 3)
    got = client.generate("m0", ids, max_new_tokens=62)
    assert np.array_equal(got, _own_generate(resident, ids, 62))
    with pytest.raises(ServiceError, match="a prompt of 3 tokens plus max_new_tokens=63 is over the model's 64 "
                                           "positions"):
        client.generate("m0", ids, max_new_tokens=63)


def test_infer_refuses_prompts_the_lm_has_no_positions_for(client):
    """An empty prompt, or an infer longer than the model's positions, failed inside MindSpore:
    INTERNAL with a C++ stack for the client. Now BAD_REQUEST saying why."""
    for ids, why in ((np.zeros((1, 0), np.int64), "empty"), (_ids(0, 1, 80), "over the model's 64 positions")):
        with pytest.raises(ServiceError, match=why) as err:
            client.infer("m0", ids)
        assert err.value.code == "BAD_REQUEST", err.value
    with pytest.raises(ServiceError, match="empty"):
        client.generate("m0", np.zeros((1, 0), np.int64), max_new_tokens=2)
    assert client.infer("m0", _ids(0, 1, 64))[0].shape[:2] == (1, 64)


class _DuckLM:
    """mindone's LlamaForCausalLM as the adapter sees it: an output object with .logits,
    generate returning prompt + new ids."""

    def __init__(self, inner):
        self.inner, self.config = inner, inner.config

    def __call__(self, input_ids):
        logits, _ = self.inner(input_ids)
        return type("CausalLMOutputWithPast", (), {"logits": logits})()

    def generate(self, input_ids, max_new_tokens, do_sample):
        return self.inner.generate(input_ids, max_new_tokens=max_new_tokens, do_sample=do_sample)


def test_the_adapter_is_duck_typed(resident):
    s = CausalLMServable(_DuckLM(resident))
    ids = _ids(5, 2, 3)
    assert s.inputs[0].high == 64 and s.inputs[0].dtype == "int64"
    assert np.array_equal(s.generate(ids, 4), _own_generate(resident, ids, 4))
    assert s.forward(ids).shape == (2, 3, 64)


def test_an_hf_style_cell_is_served_through_the_adapter(resident, tmp_path):
    """A Cell with transformers' interface (.logits outputs, generate returning prompt +
    new ids; tests/serve/_servables.py:hf_style_lm), served offloaded in a real worker."""
    import mindspore as ms
    spec = ServeSpec(models=1, model="_servables:hf_style_lm", budget=BUDGET, lookahead=1,
                     store_dir=str(tmp_path))
    ids = _ids(7, 2, 4)
    with Front(f"ipc://hf-{os.getpid()}-{secrets.token_hex(2)}.sock", workers=1, spec=spec,
               request_timeout=60.0, name=f"hf{os.getpid()}").start() as front:
        with Client(front.endpoint, timeout=60) as c:
            got = c.generate("m0", ids, max_new_tokens=5)
            (logits,) = c.infer("m0", ids)
    assert np.array_equal(got, _own_generate(resident, ids, 5))
    np.testing.assert_allclose(logits, resident(ms.Tensor(ids))[0].asnumpy(), rtol=1e-5, atol=1e-5)


class _NewOnlyLM(_DuckLM):
    """A generate that returns only the new ids, which here repeat the prompt's last id."""

    def generate(self, input_ids, max_new_tokens, do_sample):
        import mindspore as ms
        ids = input_ids.asnumpy()
        return ms.Tensor(np.repeat(ids[:, -1:], max_new_tokens, axis=1))


def test_a_generate_without_the_prompt_is_refused_not_cut(resident):
    """New ids [[3, 3, 3, 3]] for the prompt [[3]] start with the prompt: the adapter took
    them for prompt + new and answered [[3, 3, 3]] (outside probe)."""
    s = CausalLMServable(_NewOnlyLM(resident))
    with pytest.raises(RuntimeError, match=r"shape \[1, 4\], not the prompt \(1 ids\) and 4 new ones"):
        s.generate(np.array([[3]], np.int64), 4)
    with pytest.raises(RuntimeError, match="servable object"):
        s.generate(np.array([[3, 7]], np.int64), 4)


class _StopsEarlyLM(_DuckLM):
    """transformers' generate: stops at an end-of-sequence id unless min_new_tokens says not."""

    def generate(self, input_ids, max_new_tokens, do_sample, **kwargs):
        import mindspore as ms
        ids = input_ids.asnumpy()
        n = kwargs.get("min_new_tokens") or 1
        return ms.Tensor(np.concatenate([ids, np.full((ids.shape[0], n), 2, ids.dtype)], axis=1))


def test_a_generate_that_takes_min_new_tokens_answers_n_new_ids(resident):
    s = CausalLMServable(_StopsEarlyLM(resident))
    assert s.generate(np.array([[3, 7]], np.int64), 5).tolist() == [[2, 2, 2, 2, 2]]
