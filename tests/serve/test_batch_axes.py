"""Batched requests are split back along the axis the model's rows are on: the inputs' batch
axis unless the servable says otherwise (prefetchd/serve/servable.py), and only once a model's
first joined batch split into what each request computes alone (prefetchd/serve/execute.py).
A worker's batches are run here in-process (execute.run_batch), with real MindSpore cells."""
import numpy as np
import pytest

from prefetchd.config import ConfigError
from prefetchd.serve import TensorSpec
from prefetchd.serve.execute import finish_join_checks, run_batch
from prefetchd.serve.servable import JoinCheck, ServedModel, as_servable
from prefetchd.serve.wire import decode_arrays, encode_arrays


def _batch(model, requests, max_bytes=1 << 30):
    """Each request's outputs from one joined batch, as a worker computes them."""
    parts, frames = [], []
    for arrays in requests:
        headers, buffers = encode_arrays(arrays)
        parts.append({"inputs": headers})
        frames.extend(buffers)
    result, out = run_batch(model, {"model": "m0", "kind": "infer", "parts": parts}, frames, max_bytes)
    finish_join_checks([model])                   # as a worker does once it replied
    answers, at = [], 0
    for i, headers in enumerate(result["outputs"]):
        if str(i) in result["errors"]:            # this request's own error
            answers.append(result["errors"][str(i)])
            continue
        answers.append([np.array(a) for a in decode_arrays(headers, out[at:at + len(headers)], what="output")])
        at += len(headers)
    _batch.last = result
    return answers


def _generate_batch(model, prompts, n=2):
    """run_batch of one generate job for `prompts`: (each answer or its error, the result)."""
    parts, frames = [], []
    for p in prompts:
        headers, buffers = encode_arrays([p])
        parts.append({"inputs": headers})
        frames.extend(buffers)
    result, out = run_batch(model, {"model": "m0", "kind": "generate", "parts": parts, "max_new_tokens": n},
                            frames, 1 << 20)
    finish_join_checks([model])
    answers, at = [], 0
    for i in range(len(prompts)):
        if str(i) in result["errors"]:
            answers.append(result["errors"][str(i)])
            continue
        answers.append(decode_arrays(result["outputs"][i], out[at:at + 1], what="output")[0])
        at += 1
    return answers, result


def _generating(ms, generate):
    """A ServedModel of a servable object whose generate is `generate(ids, max_new_tokens)`
    (its forward gives the ids back)."""
    class Generating:
        cell = ms.nn.Dense(2, 2)
        inputs = [TensorSpec((None, 3), "int64", name="input_ids")]

        def forward(self, ids):
            return ids

        def generate(self, ids, max_new_tokens):
            return generate(ids, max_new_tokens)
    return ServedModel("m0", as_servable(Generating(), "t:f"), handle=None, hints=[])


def _time_major(ms):
    """A cell over (time, batch, features) inputs: the rows are on axis 1."""
    class TimeMajor(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = ms.nn.Dense(16, 8)

        def construct(self, x):
            return self.dense(x) * 2
    return TimeMajor()


def test_rows_on_axis_1_come_back_to_their_own_request(mindspore_cpu):
    ms = mindspore_cpu
    cell = _time_major(ms)
    servable = as_servable((cell, [TensorSpec((4, None, 16), "float32", batch_axis=1, name="x")]), "t:f")
    model = ServedModel("m0", servable, handle=None, hints=[])
    rng = np.random.default_rng(0)
    # Two 2-row requests join into (4, 4, 16): axis 0 is also 4 long, so splitting the wrong
    # axis gave each request (2, 4, 8) of mixed rows, with no error. The first joined batch
    # is checked against each request alone; the next ones are split.
    for _ in range(3):
        requests = [[rng.standard_normal((4, 2, 16)).astype(np.float32)] for _ in range(2)]
        for (x,), (answer,) in zip(requests, _batch(model, requests)):
            assert answer.shape == (4, 2, 8)
            np.testing.assert_allclose(answer, cell(ms.Tensor(x)).asnumpy(), rtol=1e-6, atol=1e-6)
    assert model.joins["infer"].verdict is True


def _with_state(ms, extra):
    """Outputs (per-row values, something else): a last state whose rows are on axis 0 while
    the input's are on axis 1 ("state"), or a fixed vector of 4 ("fixed"), or a scalar."""
    class WithState(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = ms.nn.Dense(4, 4)

        def construct(self, x):
            y = self.dense(x)
            if extra == "state":
                return y, y[-1]
            if extra == "fixed":
                return y, self.dense.bias * 1
            return y, y.mean()
    return WithState()


@pytest.mark.parametrize("extra", ["state", "fixed", "scalar"])
def test_an_output_that_does_not_split_per_request_runs_requests_alone(mindspore_cpu, extra):
    """A (4, 4) state or a fixed (4,) vector beside rows on axis 1, for two 2-row requests:
    its size on the axis happens to be the batch's 4 rows, so it was cut with no error (each
    request got half of the vector, or the state transposed); a scalar failed every batched
    request. Now the first joined batch is checked and the model's requests run alone."""
    ms = mindspore_cpu
    cell = _with_state(ms, extra)
    servable = as_servable((cell, [TensorSpec((4, None, 4), "float32", batch_axis=1, name="x")]), "t:f")
    model = ServedModel("m0", servable, handle=None, hints=[])
    rng = np.random.default_rng(1)
    for _ in range(2):
        requests = [[rng.standard_normal((4, 2, 4)).astype(np.float32)] for _ in range(2)]
        for (x,), answers in zip(requests, _batch(model, requests)):
            want = [o.asnumpy() for o in cell(ms.Tensor(x))]
            assert [a.shape for a in answers] == [w.shape for w in want]
            for a, w in zip(answers, want):
                assert np.array_equal(a, w)
    assert model.joins["infer"].verdict is False


def test_identical_requests_do_not_vouch_for_a_model_whose_rows_depend_on_each_other(mindspore_cpu):
    """y - y.mean(0): a first joined batch of two identical requests (warm-up, health checks)
    split right, so joining was on for good and later requests got answers that depended on
    the other rows of their batch. Identical requests no longer count; distinct ones show it."""
    ms = mindspore_cpu

    class Centered(ms.nn.Cell):
        def construct(self, x):
            return x - x.mean(0)
    cell = Centered()
    servable = as_servable((cell, [TensorSpec((None, 4), "float32", name="x")]), "t:f")
    model = ServedModel("m0", servable, handle=None, hints=[])
    rng = np.random.default_rng(2)
    same = rng.standard_normal((2, 4)).astype(np.float32)
    same[0, 0] = np.nan                  # NaN != NaN: identical requests must still count as identical
    for _ in range(4):
        _batch(model, [[same], [same]])
    assert model.joins["infer"] == JoinCheck()
    for _ in range(3):
        requests = [[rng.standard_normal((2, 4)).astype(np.float32)] for _ in range(2)]
        for (x,), (answer,) in zip(requests, _batch(model, requests)):
            np.testing.assert_allclose(answer, cell(ms.Tensor(x)).asnumpy(), rtol=1e-6, atol=1e-6)
    assert model.joins["infer"].verdict is False


def test_inputs_batching_along_different_axes_need_the_servable_to_say(mindspore_cpu):
    ms = mindspore_cpu
    specs = [TensorSpec((None, 16), "float32", 0, "a"), TensorSpec((16, None), "float32", 1, "b")]
    with pytest.raises(ConfigError, match=r"batch along axes \[0, 1\].*output_batch_axis"):
        as_servable((_time_major(ms), specs), "t:f")


def test_an_output_over_the_tensor_limit_is_refused_by_the_worker_saying_so(mindspore_cpu):
    """A small request whose output is large (here 64x its input) was computed and shipped
    past max_tensor_bytes; the client then refused it as if its request were bad."""
    ms = mindspore_cpu

    class Widen(ms.nn.Cell):
        def construct(self, x):
            return ms.ops.tile(x, (1, 64))
    servable = as_servable((Widen(), [TensorSpec((None, 16), "float32", name="x")]), "t:f")
    model = ServedModel("m0", servable, handle=None, hints=[])
    x = np.ones((4, 16), np.float32)                         # 256 bytes in, 16 KiB out
    assert _batch(model, [[x]], max_bytes=16 << 10)[0][0].shape == (4, 1024)
    (error,) = _batch(model, [[x]], max_bytes=8 << 10)
    assert error["code"] == "BAD_REQUEST" and "over the server's limit of 8192 (--max-request-bytes): send fewer rows" \
        in error["reason"], error


def test_a_request_whose_input_makes_the_model_raise_fails_alone(mindspore_cpu, caplog):
    """A model that raised on one request's input (NaN here) failed the whole joined batch:
    every batch-mate got that request's error. The parts now run alone after a joined
    forward raises, and only the one whose input it was fails; the worker logs its error
    once (it was logged chained to the joined call's: two tracebacks per failed request)."""
    ms = mindspore_cpu

    class Picky(ms.nn.Cell):
        def construct(self, x):
            if bool(ms.ops.isnan(x).any()):
                raise ValueError("NaN in the input")
            return x * 2
    servable = as_servable((Picky(), [TensorSpec((None, 4), "float32", name="x")]), "t:f")
    model = ServedModel("m0", servable, handle=None, hints=[])
    rng = np.random.default_rng(4)
    requests = [[rng.standard_normal((1 + i, 4)).astype(np.float32)] for i in range(4)]
    requests[2][0][0, 1] = np.nan
    with caplog.at_level("WARNING", logger="prefetchd.serve"):
        answers = _batch(model, requests)
    assert answers[2]["code"] == "INTERNAL" and "NaN in the input" in answers[2]["reason"], answers[2]
    (logged,) = [r for r in caplog.records if "request failed" in r.getMessage()]
    assert logged.exc_info[1].__context__ is None, "logged chained to the joined call's error"
    for i in (0, 1, 3):
        np.testing.assert_array_equal(answers[i][0], requests[i][0] * 2)
    assert _batch.last["ran"] == [1, 2, 0, 4]               # each ran alone: its own rows


def test_a_prompt_that_makes_generate_raise_fails_alone(mindspore_cpu):
    """A joined generate that raised failed every request in the batch with one prompt's
    error. Its parts now run alone after it raises, as a forward's do."""
    ms = mindspore_cpu

    def generate(ids, max_new_tokens):
        if (ids < 0).any():
            raise ValueError("a negative token id")
        return np.repeat(ids[:, -1:] + 1, max_new_tokens, axis=1)
    model = _generating(ms, generate)
    prompts = [np.full((1 + i % 2, 3), i, np.int64) for i in range(4)]
    prompts[1][0, 0] = -1
    answers, result = _generate_batch(model, prompts)
    assert list(result["errors"]) == ["1"] and "a negative token id" in result["errors"]["1"]["reason"]
    assert result["ran"] == [1, 0, 1, 2] and result["forwards"] == [1, 2, 1, 2]    # each alone
    for i in (0, 2, 3):
        np.testing.assert_array_equal(answers[i], np.full((len(prompts[i]), 2), i + 1, np.int64))


def test_an_output_the_wire_cannot_carry_fails_its_own_request_only(mindspore_cpu):
    """A generate that returned None (an object array) for one prompt: its batch-mates were
    computed right, alone, and their answers dropped with it, all failed INTERNAL."""
    ms = mindspore_cpu

    def generate(ids, max_new_tokens):
        return None if (ids == 13).any() else ids[:, -1:] + np.arange(1, max_new_tokens + 1)
    model = _generating(ms, generate)
    answers, result = _generate_batch(model, [np.full((1, 3), value, np.int64) for value in (5, 13, 20)])
    # (None is refused as no token ids before the wire would refuse it: "dtype object is not
    # carried on the wire", which did not say whose fault it was.)
    assert list(result["errors"]) == ["1"] and "returns the new token ids" in answers[1]["reason"]
    assert [answers[0].tolist(), answers[2].tolist()] == [[[6, 7]], [[21, 22]]]


def test_a_model_whose_rows_are_independent_keeps_joining_despite_rounding(mindspore_cpu):
    """The check that joined outputs split into each request's own compared each element
    with an absolute tolerance of 1e-6: the logits of prefetchd's own tiny LM (up to ~10,
    summed in another order at another batch size) differ by ~1e-5 near zero, so the model
    was judged to have rows that depend on each other and ran one request at a time."""
    from prefetchd.serve.tiny_lm import build
    servable = as_servable(build(seed=0), "tiny_lm")
    model = ServedModel("m0", servable, handle=None, hints=[])
    rng = np.random.default_rng(0)
    for _ in range(3):
        _batch(model, [[rng.integers(0, 64, (1, 6)).astype(np.int64)] for _ in range(8)])
    assert model.joins["infer"].verdict is True
    assert _batch.last["ran"] == [1] * 8 and _batch.last["forwards"] == [1] * 8   # checked: answered alone
    _batch(model, [[rng.integers(0, 64, (1, 6)).astype(np.int64)] for _ in range(8)])
    assert _batch.last["forwards"] == [8] and _batch.last["ran"] == [8] * 8     # one forward now


def test_the_demo_models_rows_both_near_zero_at_one_place_keep_it_joining(mindspore_cpu):
    """The per-element scale is the smallest along the output's axes; along the batch axis
    of two one-row requests it is two values. Both near zero at one place (0.0029 and
    -0.0029 here) made that element's tolerance 3e-7, under the rounding of ~1e-6 carried
    from the terms it was summed from: the demo model failed its join check on 6 of 10 fresh
    servers and ran one request at a time (an outside probe). Pairs 18 and 53 of this seed
    are two such; the floor (a low quantile of the scales) keeps them joining."""
    ms = mindspore_cpu
    from prefetchd.demo.model import build_model
    cell = build_model(hidden=64, layers=2, seed=0)
    rng = np.random.default_rng(0)
    pairs = [rng.standard_normal((2, 8, 64)).astype(np.float32) for _ in range(54)]
    servable = as_servable((cell, [TensorSpec((None, 8, 64), "float32", name="x")]), "t:f")
    model = ServedModel("m0", servable, handle=None, hints=[])
    for x in (pairs[18], pairs[53], pairs[0]):
        answers = _batch(model, [[x[:1]], [x[1:]]])
        for row, (y,) in zip((x[:1], x[1:]), answers):
            np.testing.assert_array_equal(y, cell(ms.Tensor(row)).asnumpy())   # checked: answered alone
    assert model.joins["infer"].verdict is True


@pytest.mark.parametrize("mask", ["column", "position"])
def test_a_masked_logit_does_not_hide_rows_that_depend_on_each_other(mindspore_cpu, mask):
    """The tolerance was relative to the largest magnitude of the whole output: one logit
    masked at -1e9 (a banned token's column, or a padded position) made it 1e5, a model that
    subtracts the batch mean passed its checks, and clients got rows mixed with each other's
    (an outside probe). Along some axis each element's neighbours are unmasked now."""
    ms = mindspore_cpu

    class Centred(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = ms.nn.Dense(8, 16)

        def construct(self, x):
            y = self.dense(x)
            y = y - y.mean(axis=0, keep_dims=True)          # rows depend on each other
            if mask == "column":
                return ms.ops.concat((ms.ops.full((y.shape[0], y.shape[1], 1), -1e9, dtype=ms.float32), y[..., 1:]), -1)
            return ms.ops.concat((ms.ops.full((y.shape[0], 1, y.shape[2]), -1e9, dtype=ms.float32), y[:, 1:]), 1)
    cell = Centred()
    servable = as_servable((cell, [TensorSpec((None, 3, 8), "float32", name="x")]), "t:f")
    model = ServedModel("m0", servable, handle=None, hints=[])
    rng = np.random.default_rng(3)
    for rows in (1, 2):
        requests = [[rng.standard_normal((rows, 3, 8)).astype(np.float32)] for _ in range(4)]
        for (x,), (y,) in zip(requests, _batch(model, requests)):
            np.testing.assert_array_equal(y, cell(ms.Tensor(x)).asnumpy())
    assert model.joins["infer"].verdict is False


def test_a_model_with_masked_logits_whose_rows_are_independent_still_joins(mindspore_cpu):
    """The per-element tolerance keeps a model whose rows are independent joining though
    some of its outputs are -1e9 and others near zero."""
    ms = mindspore_cpu

    class Masked(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = ms.nn.Dense(8, 64)

        def construct(self, x):
            y = self.dense(x)
            return ms.ops.concat((ms.ops.full((y.shape[0], 2), -1e9, dtype=ms.float32), y[:, 2:]), -1)
    servable = as_servable((Masked(), [TensorSpec((None, 8), "float32", name="x")]), "t:f")
    model = ServedModel("m0", servable, handle=None, hints=[])
    rng = np.random.default_rng(4)
    for _ in range(3):
        _batch(model, [[rng.standard_normal((1, 8)).astype(np.float32) * 10] for _ in range(8)])
    assert model.joins["infer"].verdict is True


def test_a_generate_that_reorders_its_rows_never_hands_a_client_anothers_tokens(mindspore_cpu):
    """A joined generate's output was split by rows with no check: a servable whose batched
    generate returns its rows in another order (here reversed) gave each client another's
    tokens. Joined generates are now checked against each prompt alone, as forwards are, and
    on their own: a model whose forwards join may still generate one request at a time."""
    ms = mindspore_cpu

    def generate(ids, max_new_tokens):
        new = ids[:, -1:] + np.arange(1, max_new_tokens + 1)
        return new[::-1]                          # right alone (one row), wrong joined
    model = _generating(ms, generate)
    for round_ in range(5):
        v = 10 * round_
        answers, result = _generate_batch(model, [np.full((1, 3), v, np.int64), np.full((1, 3), v + 5, np.int64)])
        assert [a.tolist() for a in answers] == [[[v + 1, v + 2]], [[v + 6, v + 7]]]
        assert result["ran"] == [1, 1]
    assert model.joins["generate"].verdict is False
    for _ in range(3):                                # its forwards still join once checked
        _batch(model, [[np.full((1, 3), v, np.int64)] for v in (1, 2)])
    assert model.joins["infer"].verdict is True


def test_a_check_whose_rows_all_give_the_same_tokens_proves_nothing(mindspore_cpu):
    """Distinct prompts whose tokens coincide passed all three checks of a generate that
    reverses its rows (probe Q): from then on every client got another's tokens."""
    ms = mindspore_cpu

    def generate(ids, max_new_tokens):
        new = ids[:, -1:] // 100 + np.arange(1, max_new_tokens + 1)     # ids < 100: all the same
        return new[::-1]
    model = _generating(ms, generate)
    for round_ in range(4):
        prompts = [np.full((1, 3), v, np.int64) for v in (round_, round_ + 10)]
        answers, _ = _generate_batch(model, prompts)
        assert [a.tolist() for a in answers] == [[[1, 2]], [[1, 2]]]
        assert model.joins["generate"] == JoinCheck()          # inconclusive: not counted
    prompts = [np.full((1, 3), v, np.int64) for v in (100, 500)]
    answers, _ = _generate_batch(model, prompts)
    assert [a.tolist() for a in answers] == [[[2, 3]], [[6, 7]]]
    assert model.joins["generate"].verdict is False


def test_a_generate_that_returns_other_than_new_token_ids_fails_its_request(mindspore_cpu):
    """A servable object's generate result went to the client as it was: prompt + new ids
    (1, 9) for max_new_tokens 4, floats, a 0-d array. The wire promises (batch, N) int64."""
    ms = mindspore_cpu

    def generate(ids, max_new_tokens):
        kind = int(ids[0, 0])
        new = np.tile(np.arange(max_new_tokens), (len(ids), 1))
        return {0: new.astype(np.int32), 1: np.concatenate([ids, new], axis=1),
                2: new.astype(np.float32), 3: np.int64(5)}[kind]
    model = _generating(ms, generate)
    for kind in range(4):
        (answer,), _ = _generate_batch(model, [np.full((1, 3), kind, np.int64)], n=4)
        if kind == 0:                                       # int32 ids: given as int64
            assert answer.dtype == np.int64 and answer.tolist() == [[0, 1, 2, 3]]
        else:
            assert answer["code"] == "INTERNAL" and "returns the new token ids" in answer["reason"], answer


def test_a_slow_models_join_check_counts_the_parts_that_ran_before_their_deadline(mindspore_cpu):
    """The first joined batches ran joined, then each part alone (n parts: n + 1 forwards
    before any reply), and a part whose deadline passed meanwhile got TIMEOUT, which made the
    batch count as no check: a model slow enough to time a part out was checked again at
    every joined batch, and timed out again, for as long as the server ran (an outside probe:
    4 requests of a 2 s model under --request-timeout 8, TIMEOUT every round). Now each part
    is answered from its own forward and the joined call runs after the reply, compared with
    the parts that ran; after JOIN_CHECKS batches the model's batches run joined."""
    import time

    from prefetchd.serve.execute import JOIN_CHECKS
    ms = mindspore_cpu
    cell = ms.nn.Dense(4, 4)
    servable = as_servable((cell, [TensorSpec((None, 4), "float32", name="x")]), "t:f")
    model = ServedModel("m0", servable, handle=None, hints=[])
    rng = np.random.default_rng(2)

    def batch(expired):
        requests = [[rng.standard_normal((1, 4)).astype(np.float32)] for _ in range(4)]
        parts, frames = [], []
        for i, arrays in enumerate(requests):
            headers, buffers = encode_arrays(arrays)
            late = i == 3 and expired                     # its deadline passed while others ran
            parts.append({"inputs": headers, "deadline": time.monotonic() + (-1 if late else 600)})
            frames.extend(buffers)
        result, out = run_batch(model, {"model": "m0", "kind": "infer", "parts": parts}, frames, 1 << 20)
        finish_join_checks([model])
        answered = [i for i in range(4) if str(i) not in result["errors"]]
        for at, i in enumerate(answered):                    # one output each
            (y,) = decode_arrays(result["outputs"][i], out[at:at + 1], what="output")
            np.testing.assert_allclose(np.array(y), cell(ms.Tensor(requests[i][0])).asnumpy(), rtol=1e-6,
                                       atol=1e-6)
        return result, answered

    for _ in range(JOIN_CHECKS):
        result, answered = batch(expired=True)
        assert answered == [0, 1, 2] and result["errors"]["3"]["code"] == "TIMEOUT"
        assert result["forwards"] == [1, 1, 1]        # each part that could run (the joined call: after)
    assert model.joins["infer"].verdict is True
    result, answered = batch(expired=False)
    assert answered == [0, 1, 2, 3] and result["forwards"] == [4]
