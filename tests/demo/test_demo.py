"""The demo model (tied embedding, top-level parameters) and `run_demo`: the
README's usage, outputs checked against the resident model, a where-the-time-
went table, progress lines when not on a terminal, bad options refused."""
import argparse
import json
import sys
import time

import numpy as np
import pytest

import prefetchd
from prefetchd.demo import run as demo_mod
from prefetchd.demo.model import (MAX_SEQ, block_params, build_model, estimate_bytes, layers_for, make_inputs,
                             top_params, vocab_for)

SMALL = dict(size=24 << 20, hidden=256, passes=2, batch=2, seq=8)


def test_model_has_a_tied_embedding_and_top_level_parameters(ms):
    model = build_model(64, 2, seed=3)
    own = {p.name for p in model._params.values()}        # parameters of the top cell itself
    assert own == {"embedding", "pos_embed", "final_norm.gamma", "final_norm.beta"}
    assert tuple(model.embedding.shape) == (vocab_for(64), 64)
    params = list(model.get_parameters())
    assert sum(int(np.prod(p.shape)) for p in params) * 4 == estimate_bytes(64, 2)
    assert top_params(64) + 2 * block_params(64) == estimate_bytes(64, 2) // 4

    ids = make_inputs(2, 5, 64, seed=7)
    assert ids.dtype == ms.int32 and ids.shape == (2, 5)
    assert 0 <= int(ids.asnumpy().min()) and int(ids.asnumpy().max()) < vocab_for(64)
    logits = model(ids).asnumpy()
    assert logits.shape == (2, 5, vocab_for(64))
    hidden_in = ms.Tensor(np.random.default_rng(0).standard_normal((2, 5, 64), dtype=np.float32))
    before_ids, before_hidden = logits, model(hidden_in).asnumpy()

    # Tied: the one table feeds the input lookup and the output projection. Scaling
    # it changes the logits of hidden-state inputs too (no lookup on that path).
    model.embedding.set_data(ms.Tensor(model.embedding.asnumpy() * 2))
    assert not np.allclose(model(hidden_in).asnumpy(), before_hidden)
    assert not np.allclose(model(ids).asnumpy(), before_ids)
    # The positional embedding and the final norm are read in the top-level construct.
    model.pos_embed.set_data(ms.Tensor(model.pos_embed.asnumpy() + 1))
    changed = model(hidden_in).asnumpy()
    model.norm_beta.set_data(ms.Tensor(np.ones(64, np.float32)))
    assert not np.allclose(model(hidden_in).asnumpy(), changed)


def test_model_sizes_and_bad_sequence_lengths(ms):
    assert estimate_bytes(512, layers_for(96 << 20, 512)) == pytest.approx(96 << 20, rel=0.1)
    assert layers_for(1, 512) == 1
    with pytest.raises(ValueError, match="seq 200"):
        make_inputs(1, 200, 64)
    model = build_model(64, 1)
    with pytest.raises(ValueError, match=f"{MAX_SEQ} positions"):
        model(ms.Tensor(np.zeros((1, MAX_SEQ + 1, 64), np.float32)))


def test_unmaterialized_model_allocates_no_weights(ms):
    seen = []
    build_model(64, 2, materialize=True, progress=lambda done, total: seen.append((done, total)))
    n = len(list(build_model(64, 2, materialize=False).get_parameters()))
    assert seen[-1] == (n, n) and [d for d, _ in seen] == list(range(1, n + 1))


def test_demo_uses_the_readme_defaults_and_matches_the_resident_model(ms, monkeypatch, capsys):
    calls = {}
    real_offload, real_daemon = prefetchd.offload, prefetchd.daemon.Daemon

    def offload_spy(model, daemon, **kwargs):
        calls["offload"] = kwargs
        return real_offload(model, daemon, **kwargs)

    class DaemonSpy(real_daemon):
        def __init__(self, *args, **kwargs):
            calls["daemon"] = kwargs
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(prefetchd, "offload", offload_spy)
    monkeypatch.setattr(prefetchd.daemon, "Daemon", DaemonSpy)

    assert demo_mod.run_demo(**SMALL) == 0
    out, err = capsys.readouterr()
    # README: Daemon(device_budget=..., store_dir=...), offload(model, daemon, lookahead=2);
    # the weights are in the store already (checkpoint=True). No private switches.
    assert calls["offload"] == {"lookahead": 2, "checkpoint": True}
    assert set(calls["daemon"]) <= {"device_budget", "store_dir", "metrics_port", "name", "trace"}
    assert "outputs: identical to the resident model" in out
    table = out[out.index("where the time went"):]
    assert "compute" in table and "stall" in table
    assert "load" in table          # the I/O rows: weights came from the store
    # Progress of the long phases; stderr is not a terminal here: whole lines.
    assert "prefetchd demo: staging:" in err and "prefetchd demo: building the resident model:" in err
    assert "\r" not in err


def test_demo_json_report(ms, capsys):
    assert demo_mod.run_demo(json=True, **SMALL) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["outputs_match"] and report["watermark_respected"] and report["passes"] == 2
    # The resident model is timed before and after the offloaded passes.
    assert len(report["resident_pass_seconds"]) == 2 * report["passes"]
    middle = sorted(report["resident_pass_seconds"])[1:3]
    assert report["resident_seconds_per_pass"] == pytest.approx(sum(middle) / 2)
    assert report["peak_device_bytes"] <= report["high_watermark"] < report["model_bytes"]
    assert report["bytes_moved"] >= report["model_bytes"] * 0.5
    assert report["transfer_seconds"]["load"] > 0


def test_demo_takes_the_cli_namespace(ms, capsys):
    args = argparse.Namespace(json=True, tier="host", lookahead=1, store=None, metrics_port=None, hold=0.0,
                              budget=0.5, command="demo", func=None, **SMALL)
    assert demo_mod.run_demo(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tier"] == "host" and report["lookahead"] == 1 and report["outputs_match"]


@pytest.mark.parametrize("options, error, needle", [
    ({"budget": 1.5}, ValueError, "budget"),
    ({"budget": 0}, ValueError, "budget"),
    ({"tier": "tape"}, ValueError, "'tape'"),
    ({"colour": "blue"}, TypeError, "colour"),
    ({"seq": 1000}, ValueError, "seq 1000: the demo model has 128 positions"),   # was refused after staging
])
def test_bad_demo_options_are_refused_by_name(options, error, needle):
    with pytest.raises(error, match=needle):
        demo_mod.run_demo(**options)


def test_a_model_the_machine_cannot_hold_is_refused_before_anything_is_staged(monkeypatch, tmp_path):
    # `demo --size 100GiB` on a 24 GiB machine was accepted: it would fill the disk, then
    # build the resident reference in RAM.
    from prefetchd import limits
    monkeypatch.setattr(limits, "available_memory", lambda: limits.Available(16 << 20, "a small test machine"))
    with pytest.raises(ValueError, match=r"the demo needs about .* of RAM .* more than 90% of the 16.0 MiB of "
                                         r"a small test machine; give a smaller --size"):
        demo_mod.checked_options(**SMALL)
    with pytest.raises(ValueError, match="its host tier"):
        demo_mod.checked_options(**{**SMALL, "size": 32 << 20, "tier": "host"})
    monkeypatch.undo()
    import shutil
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, 1 << 20))
    with pytest.raises(ValueError, match=rf"staging it needs .* of disk, and {tmp_path} has 1.0 MiB free"):
        demo_mod.checked_options(**SMALL, store=str(tmp_path / "new" / "store"))
    assert not (tmp_path / "new").exists()


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    started = time.monotonic()
    with pytest.raises(ImportError, match=r"prefetchd\[plot\]"):
        demo_mod.run_demo(plot="t.png", **SMALL)
    assert time.monotonic() - started < 1.0     # nothing was staged or run


def test_demo_keeps_no_large_reference_beside_the_offloaded_model(ms, monkeypatch, capsys):
    """A model over a third of the memory the machine allows: the resident reference is
    dropped before the offloaded passes (it, the host cache and the arena would not fit
    together), and only the resident passes before them are timed."""
    from prefetchd import limits
    model_bytes = estimate_bytes(SMALL["hidden"], layers_for(SMALL["size"], SMALL["hidden"]))
    monkeypatch.setattr(limits, "available_memory",
                        lambda *a, **k: limits.Available(model_bytes * 3 - 1, "a test's machine"))
    assert demo_mod.run_demo(json=True, **SMALL) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["resident_pass_seconds"]) == report["passes"]
    assert report["outputs_match"]


def test_the_configured_trace_is_written_and_settings_the_demo_sets_itself_are_named(ms, monkeypatch,
                                                                                      capsys, tmp_path):
    # PREFETCHD_TRACE, PREFETCHD_DEVICE_BUDGET, PREFETCHD_STORE_DIR and PREFETCHD_LOOKAHEAD
    # were all dropped without a word: no trace file, and a budget not the one configured.
    monkeypatch.setenv("PREFETCHD_TRACE", str(tmp_path / "t.json"))
    monkeypatch.setenv("PREFETCHD_DEVICE_BUDGET", "8MiB")
    monkeypatch.setenv("PREFETCHD_STORE_DIR", str(tmp_path / "store"))
    assert demo_mod.run_demo(**SMALL) == 0
    out = capsys.readouterr().out
    assert ("note: the demo sets device_budget, store_dir itself (--budget, --store): env "
            "PREFETCHD_DEVICE_BUDGET, env PREFETCHD_STORE_DIR not applied") in out, out
    assert json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert not (tmp_path / "store").exists()        # the demo's store is its own, removed after
