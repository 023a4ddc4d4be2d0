"""Layer decorators: an offloaded model computes exactly what the resident model computes."""
import threading
import time

import numpy as np
import pytest

import prefetchd
from prefetchd.errors import NotResidentError, PrefetchdError
from prefetchd.demo.model import block_params, build_model, estimate_bytes, make_inputs

H, L = 256, 6


@pytest.fixture(scope="module")
def reference(mindspore_cpu):
    model = build_model(H, L, seed=3)
    x = make_inputs(2, 4, H, seed=5)
    return x, model(x).asnumpy(), model


def offloaded(make_daemon, budget_fraction, **kwargs):
    size = estimate_bytes(H, L)
    daemon = make_daemon(device_budget=max(int(size * budget_fraction), 1 << 20))
    model = build_model(H, L, seed=3)
    handle = prefetchd.offload(model, daemon, **kwargs)
    return model, handle, daemon


@pytest.mark.parametrize("budget", [0.3, 0.5, 1.0])
@pytest.mark.parametrize("lookahead", [0, 1, 2, 3])
def test_offloaded_equals_resident(make_daemon, reference, budget, lookahead):
    x, want, _ = reference
    model, handle, daemon = offloaded(make_daemon, budget, lookahead=lookahead, auto_fetch=True)
    for _ in range(3):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    status = daemon.status()
    assert status["device"]["peak"] <= status["device"]["high_watermark"]
    plan = handle.plan()
    assert handle.stats()["trace"] == len(plan.units) + 1        # the root, then every unit once
    # the root holds exactly the parameters outside the blocks (final norm, embeddings if any)
    assert set(plan.root.param_names) == {p.name for p in model.get_parameters()
                                          if not p.name.startswith("blocks.")}
    if block_params(H) * 4 <= plan.unit_share:   # blocks fit their share: the units are the blocks
        assert [u.name for u in plan.units] == [f"blocks.{i}" for i in range(L)]
    else:               # a block is above its share: split so root + two units stay under the watermark
        assert len(plan.units) > L
        # every unit fits its share, or is a single layer that cannot be split further
        assert all(u.nbytes <= plan.unit_share or (len(u.cells) == 1 and not u.cells[0][1].name_cells())
                   for u in plan.units)
    if budget == 1.0:
        assert len(plan.units) == L


def test_host_tier_equals_resident(make_daemon, reference):
    x, want, _ = reference
    model, handle, daemon = offloaded(make_daemon, 0.3, lookahead=2, tier="host", auto_fetch=True)
    for _ in range(2):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert daemon.stats.transfer_bytes["h2d"] > 0 and daemon.stats.transfer_bytes["load"] == 0


def test_changed_order_resyncs_and_keeps_prefetching(make_daemon, reference, mindspore_cpu):
    """Skip a block mid-run: the hooks re-synchronise, count it, and outputs stay right."""
    x, want, ref_model = reference
    model, handle, daemon = offloaded(make_daemon, 0.4, lookahead=2, auto_fetch=True)
    np.testing.assert_array_equal(model(x).asnumpy(), want)

    # Block 2 computes nothing (identity): the units inside it never run. The block is
    # split at this budget, so block 2 itself carries no hooks.
    assert "blocks.2" not in [u.name for u in handle.plan().units]
    ref_model.blocks[2].construct = lambda inp: inp
    want_skip = ref_model(x).asnumpy()
    del ref_model.blocks[2].construct
    model.blocks[2].construct = lambda inp: inp
    def loaded():      # bytes brought to the device tier, from the store or from a host replica
        return daemon.stats.transfer_bytes["load"] + daemon.stats.transfer_bytes["h2d"]
    loads_before = loaded()
    np.testing.assert_array_equal(model(x).asnumpy(), want_skip)
    assert handle.resyncs >= 1
    assert daemon.stats.trace_resyncs == handle.resyncs
    del model.blocks[2].construct                # back to the recorded order
    np.testing.assert_array_equal(model(x).asnumpy(), want)
    # prefetch kept working after the re-sync: later units were loaded ahead, not on demand
    assert loaded() > loads_before
    assert daemon.stats.requests["prefetch", "issued"] > 0


def test_memory_is_not_reused_before_compute_finishes(make_daemon, mindspore_cpu):
    """Heavy compute, a budget of about two blocks, lookahead 1: exact outputs.

    MindSpore dispatches asynchronously on CPU; reusing a block before the
    kernels reading it ran would corrupt the result.
    """
    hidden, layers = 512, 6
    ref = build_model(hidden, layers, seed=11)
    x = make_inputs(16, 32, hidden, seed=12)
    want = ref(x).asnumpy()
    per_block = estimate_bytes(hidden, 1)
    daemon = make_daemon(device_budget=int(per_block * 2.3))
    model = build_model(hidden, layers, seed=11)
    # auto_fetch: at ~2 blocks of budget the arena fragments and some
    # prefetches cannot be placed; this test is about fencing, not hit rate.
    prefetchd.offload(model, daemon, lookahead=1, auto_fetch=True)
    for _ in range(3):
        outs = [model(x) for _ in range(2)]       # queue compute without reading results
        for out in outs:
            np.testing.assert_array_equal(out.asnumpy(), want)
    assert daemon.stats.fences > 0


def test_strict_never_raises_at_lookahead_0_where_every_unit_loads_when_called(make_daemon, reference):
    """At lookahead 0 nothing is prefetched by design: strict=True raised at every unit of
    every pass after the first (also where lookahead="auto" picked 0)."""
    x, want, _ = reference
    model, handle, daemon = offloaded(make_daemon, 0.3, lookahead=0, auto_fetch=False, strict=True)
    for _ in range(3):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
        daemon.evict(daemon.names()).result(10)
    assert handle.stats()["misses"] == 0


def test_strict_passes_recover_from_a_block_dropped_for_good(ms, make_daemon):
    """strict=True: a block skipped from some pass on raised at the unit after it on every
    pass, for good (the pass never ended, so its order never became the trace). Now the
    order is adopted after two such passes; the error says what happened."""
    class Skipping(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = ms.nn.CellList([ms.nn.Dense(64, 64) for _ in range(6)])
            self.skip = -1

        def construct(self, x):
            for i, block in enumerate(self.blocks):
                if i != self.skip:
                    x = block(x)
            return x
    ms.set_seed(4)
    model = Skipping()
    x = ms.Tensor(np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32))
    model.skip = 2
    want = model(x).asnumpy()
    model.skip = -1
    daemon = make_daemon(device_budget=3 * 20480)        # three of the six blocks
    handle = prefetchd.offload(model, daemon, lookahead=1, strict=True)
    for _ in range(2):
        model(x)
    model.skip = 2
    for _ in range(2):
        with pytest.raises(NotResidentError, match=r"strict=True.*leaves the recorded order") as err:
            model(x)
        assert err.value.name == "blocks.3.weight" or err.value.name == "blocks.3.bias"
    for _ in range(3):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert handle.stats()["misses"] == 2


def test_a_miss_is_fetched_counted_and_the_next_pass_is_normal(make_daemon, reference, caplog):
    """Default (not strict): everything evicted behind the hooks' back -> each unit misses once,
    is fetched on demand, outputs stay exact; the pass after runs without misses."""
    x, want, _ = reference
    model, handle, daemon = offloaded(make_daemon, 0.5, lookahead=2, auto_fetch=False)
    for _ in range(2):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert handle.stats()["misses"] == 0
    daemon.evict(daemon.names()).result(10)
    with caplog.at_level("WARNING", logger="prefetchd.hooks"):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    missed = handle.stats()["misses"]
    assert missed >= 1
    warnings = [r for r in caplog.records if "not resident in time" in r.getMessage()]
    assert len(warnings) == missed            # one line per unit, the first time it misses
    for _ in range(2):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert handle.stats()["misses"] == missed


def test_lookahead_and_auto_fetch_come_from_the_config(make_daemon, reference, tmp_path):
    x, want, _ = reference
    daemon = make_daemon(device_budget=int(estimate_bytes(H, L) * 0.5), lookahead=1, auto_fetch=True)
    model = build_model(H, L, seed=3)
    handle = prefetchd.offload(model, daemon)
    assert (handle.lookahead, handle.auto_fetch) == (1, True)
    assert handle.plan().lookahead == 1
    np.testing.assert_array_equal(model(x).asnumpy(), want)
    handle2 = prefetchd.offload(build_model(H, L, seed=3), make_daemon(lookahead=3, store_dir=str(tmp_path / "second")),
                                lookahead=0)
    assert (handle2.lookahead, handle2.auto_fetch) == (0, False)   # arguments beat the config


def test_auto_fetch_true_fetches_and_counts_a_miss(make_daemon, reference):
    x, want, _ = reference
    model, handle, daemon = offloaded(make_daemon, 0.3, lookahead=0, auto_fetch=True)
    model(x)
    misses = daemon.stats.requests["fetch", "miss"]
    np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert daemon.stats.requests["fetch", "miss"] > misses


def test_inplace_parameter_change_is_written_back(make_daemon, reference):
    x, _, _ = reference
    model, handle, daemon = offloaded(make_daemon, 0.3, lookahead=1)
    model(x)
    name = "blocks.0.qkv.bias"
    p = model.blocks[0].qkv.bias
    with daemon.use(name):
        p[0:3] = 1.5                                 # the user edits a weight in place
    daemon.evict(daemon.names()).result(10)          # device replicas dropped
    with daemon.use(name):
        assert list(p.asnumpy()[:3]) == [1.5, 1.5, 1.5]


def test_a_recording_pass_that_raised_midway_leaves_the_next_one_to_be_timed(make_daemon, reference):
    """lookahead="auto": a first forward that raised after some units ran left their timings
    behind, mixed into the next pass's (6 compute times for 4 units): no estimate, ever."""
    x, want, _ = reference
    model, handle, _ = offloaded(make_daemon, 0.3, lookahead="auto")
    failed = []

    def raise_once(cell, inputs):
        if not failed:
            failed.append(True)
            raise RuntimeError("boom in the second block")
    hook = model.blocks[1].register_forward_pre_hook(raise_once)
    with pytest.raises(RuntimeError, match="boom"):
        model(x)
    hook.remove()
    for _ in range(3):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert handle.estimate is not None, "the pass after a raised recording pass was not timed"
    assert handle.lookahead == handle.estimate.lookahead


def test_a_pass_that_runs_no_unit_returns_its_output_and_a_raising_pass_frees_the_model(make_daemon,
                                                                                        mindspore_cpu):
    model = build_model(64, 2)
    prefetchd.offload(model, make_daemon(), lookahead=1)
    original = model.construct
    x = make_inputs(1, 2, 64)

    def no_unit(x):           # embeddings only, every block skipped: no unit's weights are read
        return x * 2
    model.construct = no_unit
    np.testing.assert_array_equal(model(x).asnumpy(), x.asnumpy() * 2)     # was a false "compiled" error

    def broken(x):
        raise ValueError("boom")
    model.construct = broken
    with pytest.raises(ValueError, match="boom"):
        model(x)
    model.construct = original
    # The raising pass ended: a call from another thread runs (it would wait for ever otherwise).
    import threading
    done = []
    caller = threading.Thread(target=lambda: done.append(model(make_inputs(1, 2, 64)).shape), daemon=True)
    caller.start()
    caller.join(30)
    assert done, "the raising pass kept the model's pass lock"


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_a_pass_cut_short_by_ctrl_c_frees_the_model_for_other_threads(make_daemon, reference, interrupt):
    """MindSpore runs always_call hooks for an Exception only: a Ctrl-C (or SystemExit) in a
    forward left its pass lock held, so every other thread calling the model, and a
    process joining such a thread, waited for good. The right outputs after it, too."""
    x, want, _ = reference
    model, handle, _ = offloaded(make_daemon, 0.3, lookahead=1)
    np.testing.assert_array_equal(model(x).asnumpy(), want)
    armed = [True]

    def interrupt_once(cell, inputs):
        if armed.pop() if armed else False:
            raise interrupt()
    hook = model.blocks[1].register_forward_pre_hook(interrupt_once)
    with pytest.raises(interrupt):
        model(x)
    hook.remove()
    got = []
    caller = threading.Thread(target=lambda: got.append(model(x).asnumpy()), daemon=True)
    caller.start()
    caller.join(30)
    assert got, "the interrupted pass kept the model for good"
    np.testing.assert_array_equal(got[0], want)
    with handle.between_passes():              # not "refused inside this model's forward"
        pass
    np.testing.assert_array_equal(model(x).asnumpy(), want)     # and the interrupted thread's own


def test_ctrl_c_over_and_over_beside_other_threads_leaves_the_model_working(tmp_path):
    """Real interrupts (_thread.interrupt_main, in a child process) at random points of the
    main thread's forwards while two threads run the same model. One landing between the
    turn's lock and its holder's name left the lock held by nobody (every thread waited
    for good), one landing between a unit's unpin and its flag left its pins for good
    (until every forward was refused for want of room). Each now ends its own pass only."""
    import json
    import os
    import subprocess
    import sys
    child = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ctrl_c_child.py")
    out = subprocess.run([sys.executable, child, str(tmp_path / "s"), "8"], capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["interrupts"] >= 10, result
    assert result["passes"] > 0 and result["wrong"] == 0 and result["errors"] == [], result
    assert result["alive"] == 0 and result["pinned"] == 0 and result["final_equal"], result


def test_graph_mode_is_refused(make_daemon, mindspore_cpu):
    ms = mindspore_cpu
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(PrefetchdError, match="PyNative"):
            prefetchd.offload(build_model(64, 2), make_daemon())
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def test_class_decorator_offloads_instances(make_daemon, mindspore_cpu):
    ms = mindspore_cpu
    daemon = make_daemon()

    @prefetchd.offloaded(daemon, lookahead=1)
    class Net(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = ms.nn.SequentialCell([ms.nn.Dense(8, 8) for _ in range(3)])

        def construct(self, x):
            return self.layers(x)

    net = Net()
    assert len(daemon.names()) == 6
    out = net(ms.Tensor(np.ones((2, 8), np.float32)))
    assert out.shape == (2, 8)


def test_shared_weight_is_pinned_by_every_unit_that_reads_it(make_daemon, mindspore_cpu):
    """Tied weights: two units read one Parameter; both pin it, so neither reads a stale block."""
    ms = mindspore_cpu

    class Tied(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = ms.nn.CellList([ms.nn.Dense(64, 64) for _ in range(4)])
            self.layers[3].weight = self.layers[0].weight          # tied, like embedding / lm head

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    model = Tied()
    want = model(x).asnumpy()
    daemon = make_daemon(device_budget="64KiB")
    handle = prefetchd.offload(model, daemon, lookahead=1, auto_fetch=True)
    tied = handle.units[0].records[0]
    assert tied in handle.units[3].records, "the last unit must pin the weight it shares with the first"
    for _ in range(3):
        np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_set_data_by_the_user_is_adopted_and_written_back(make_daemon, ms):
    """load_param_into_net-style rebinding of a resident weight keeps the new values."""
    daemon = make_daemon(device_budget="4MiB")
    p = ms.Parameter(ms.Tensor(np.zeros(1024, np.float32)), name="w")
    h = daemon.register(p, tier="remote")
    with daemon.use(h):
        p.set_data(ms.Tensor(np.full(1024, 3, np.float32)))
    assert h._rec.dirty
    daemon.evict(h).result(10)
    with daemon.use(h):
        assert p.asnumpy()[0] == 3 and p.asnumpy()[-1] == 3
    daemon.evict(h).result(10)
    with pytest.raises(NotResidentError, match="'w'"):
        p.set_data(ms.Tensor(np.ones(1024, np.float32)))     # absent: refused, nothing half-written


def test_graph_compiled_before_offload_never_runs_stale(make_daemon, ms, tmp_path, monkeypatch):
    """A @jit block compiled with weights W1, offloaded from a checkpoint holding W2: the
    next pass computes with W2 (MindSpore's compiled phases for the cells were dropped)."""
    nn = ms.nn

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(64, 64)

        @ms.jit
        def construct(self, x):
            return self.fc(x) * 2

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([Block() for _ in range(4)])

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    def fill(net, value):
        for p in net.get_parameters():
            p.set_data(ms.Tensor(np.full(p.shape, value, np.float32)))

    x = ms.Tensor(np.full((2, 64), 0.01, np.float32))
    reference = Net()
    fill(reference, 0.02)
    w2 = reference(x).asnumpy()
    ms.save_checkpoint(reference, str(tmp_path / "w2.ckpt"))
    net = Net()
    fill(net, 0.01)
    w1 = net(x).asnumpy()                        # compiles every block with W1's storage
    assert not np.allclose(w1, w2)
    from prefetchd.backend import framework
    daemon = make_daemon(device_budget="64KiB")
    handle = prefetchd.offload(net, daemon, lookahead=1, checkpoint=str(tmp_path / "w2.ckpt"))
    for _ in range(3):
        np.testing.assert_allclose(net(x).asnumpy(), w2, rtol=1e-6)
    # If a unit's storage moves (a backend without stable addresses), the graphs compiled
    # for the old storage are dropped before the unit runs. Simulated: the record of where
    # block 0's parameters were bound says "elsewhere".
    dropped = []

    def counting(cell, real=framework.invalidate_compiled):
        dropped.append(real(cell))
        return dropped[-1]
    monkeypatch.setattr(framework, "invalidate_compiled", counting)
    handle.units[0].addresses = tuple(0 for _ in handle.units[0].addresses)
    np.testing.assert_allclose(net(x).asnumpy(), w2, rtol=1e-6)
    assert sum(dropped) >= 1, "block 0's compiled graph must be dropped"
    dropped.clear()
    np.testing.assert_allclose(net(x).asnumpy(), w2, rtol=1e-6)
    assert sum(dropped) == 0, "nothing moved: nothing recompiles"
    monkeypatch.undo()
    assert all(framework.invalidate_compiled(b) >= 1 for b in net.blocks), "recompiled after offload"


def test_lookahead_auto_is_chosen_by_the_cost_model_from_the_first_pass(make_daemon, reference):
    x, want, _ = reference
    model, handle, daemon = offloaded(make_daemon, 0.3, lookahead="auto")
    for _ in range(3):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    estimate = handle.estimate
    assert estimate is not None, "the recording pass measured no plan"
    assert handle.lookahead == estimate.lookahead <= estimate.max_lookahead
    assert estimate.pass_seconds > 0 and estimate.compute_seconds > 0
    stats = handle.stats()
    assert stats["lookahead"] == handle.lookahead and stats["predicted_pass_seconds"] == estimate.pass_seconds
    assert daemon.status()["device"]["peak"] <= daemon.status()["device"]["high_watermark"]


def test_lookahead_auto_plans_at_a_smaller_lookahead_where_only_that_fits(make_daemon, ms, tmp_path):
    """"auto" planned its units at the config's lookahead (2) before the cost model ran, and a
    budget where only lookahead 0 fits was refused with the lookahead-0 budget named in the
    message. It now plans at the largest lookahead that fits, and the cost model picks from there."""
    from prefetchd.errors import BudgetError

    class Block(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = ms.nn.Dense(128, 512), ms.nn.Dense(512, 128)

        def construct(self, x):
            return x + self.fc2(ms.ops.tanh(self.fc1(x)))

    class Net(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = ms.nn.CellList([Block() for _ in range(4)])

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return x
    x = ms.Tensor(np.ones((4, 128), np.float32))
    model = Net()
    want = model(x).asnumpy()
    daemon = make_daemon(device_budget=300_000)     # one Dense of 263 KB fits at a time: lookahead 0
    with pytest.raises(BudgetError, match="lookahead 0"):
        prefetchd.offload(Net(), daemon, lookahead=2)
    handle = prefetchd.offload(model, daemon, lookahead="auto")
    assert handle.lookahead == 0
    for _ in range(3):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert daemon.status()["device"]["peak"] <= 300_000
    with pytest.raises(BudgetError):                 # where nothing fits, "auto" is refused still
        prefetchd.offload(Net(), make_daemon(device_budget=200_000, store_dir=str(tmp_path / "small")),
                          lookahead="auto")


def fence_clocks():
    """The timing threads alive now (prefetchd.cost.model.FenceClock)."""
    return {t for t in threading.enumerate() if t.name == "prefetchd-fence-clock"}


def assert_no_new_fence_clocks(before, within=2.0):
    deadline = time.monotonic() + within
    while fence_clocks() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not fence_clocks() - before, "a timing thread outlived the handle"


def test_the_estimate_takes_compute_from_a_streamed_pass_not_the_recording_pass(make_daemon, reference):
    """The recording pass times each unit alone, so what runs beside a unit there (Python
    dispatch from an idle queue, here a sleep inside each unit's span on that pass only) is
    counted as its compute. The estimate is refined with compute timed in a streamed pass."""
    x, want, _ = reference
    before = fence_clocks()
    model, handle, daemon = offloaded(make_daemon, 1.0, lookahead=1)
    assert [u.name for u in handle.plan().units] == [f"blocks.{i}" for i in range(L)]
    slow = [True]
    for block in model.blocks:       # hooked after offload(): runs inside the unit's timed span
        block.register_forward_pre_hook(lambda cell, inputs: time.sleep(0.1) if slow[0] else None)
    np.testing.assert_array_equal(model(x).asnumpy(), want)
    recorded = handle.estimate.compute_seconds
    assert recorded >= L * 0.1
    slow[0] = False
    for _ in range(4):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    # Most of the sleeps gone; the rest is slack for the timing thread waking late on busy cores.
    assert handle.estimate.compute_seconds < recorded - L * 0.07, (recorded, handle.estimate.compute_seconds)
    handle.close()
    assert_no_new_fence_clocks(before)


def test_a_handle_closed_while_a_streamed_pass_is_being_timed_leaves_no_timing_thread(make_daemon, reference):
    x, want, _ = reference
    before = fence_clocks()
    model, handle, daemon = offloaded(make_daemon, 0.3, lookahead=1)
    for _ in range(2):               # the recording pass, then one streamed pass being timed
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    handle.close()
    assert_no_new_fence_clocks(before)


def test_a_model_staged_to_host_ram_gets_a_host_tier_estimate(make_daemon, reference):
    """Registered on the remote tier, then all staged to host RAM (what `demo --tier host`
    does): no pass reads the disk, and the cost model still predicts a pass."""
    x, want, _ = reference
    model, handle, daemon = offloaded(make_daemon, 0.3, lookahead="auto")
    daemon.stage_to_host(daemon.names()).result(timeout=60)
    for _ in range(2):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert daemon.snapshot()[1].loads_from["remote"] == 0
    assert handle.estimate is not None, "no estimate for a model held in host RAM"
    assert handle.estimate.disk_seconds == 0 and handle.estimate.pass_seconds > 0


def test_the_recording_pass_times_each_unit_with_no_load_beside_it(make_daemon, mindspore_cpu):
    """The plan times compute on the recording pass; a load on the same cores would be
    counted twice (in the time and again as copy contention), so each unit's loads wait
    for the previous unit's compute fence there. Later passes overlap them as usual."""
    from prefetchd.telemetry.timeline import COMPUTE, LOAD_STREAM, Timeline
    from prefetchd.telemetry.timeline_report import spans
    hidden, layers = 512, 4
    daemon = make_daemon(device_budget=int(estimate_bytes(hidden, layers) * 0.5))
    daemon.timeline = daemon._core.timeline = Timeline(None)
    model = build_model(hidden, layers, seed=3)
    handle = prefetchd.offload(model, daemon, lookahead=1)
    x = make_inputs(96, 64, hidden, seed=5)       # ~100 ms of compute per unit on this machine
    model(x).asnumpy()
    assert handle.estimate is not None
    recorded = spans(daemon.timeline)
    computes = [(s, e) for s, e, name, _ in recorded[COMPUTE] if name != "root"]
    loads = [(s, e) for s, e, _, _ in recorded[LOAD_STREAM]]
    assert len(computes) >= layers and loads
    # ns: a span's end is stamped by a Python thread woken by the fence, late when the
    # hooks' thread holds the GIL or the cores are busy (8 ms was exceeded under load);
    # a load beside compute would overlap most of a ~100 ms span
    slack = 30_000_000
    overlaps = [(c, l) for c in computes for l in loads if l[0] < c[1] - slack and c[0] < l[1]]
    assert not overlaps, f"loads ran beside compute on the recording pass: {overlaps[:3]}"


def test_a_second_thread_waits_for_the_running_pass_and_a_raised_pass_lets_it_go(make_daemon, mindspore_cpu):
    """Two request threads call one offloaded model: the second pass starts only when the
    first ended, whether it returned or raised (before this, the second pass unpinned
    the first's units under its running kernels, and the process could segfault)."""
    import threading
    ms = mindspore_cpu
    gate, entered = threading.Event(), []

    class Gated(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = ms.nn.CellList([ms.nn.Dense(64, 64) for _ in range(4)])

        def construct(self, x, fail=False):
            for i, layer in enumerate(self.layers):
                entered.append((threading.current_thread().name, i))
                if i == 1 and threading.current_thread().name == "first":
                    gate.wait(30)          # the first pass holds here, its units pinned
                    if fail:
                        raise ValueError("the first request was bad")
                x = layer(x)
            return x

    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32))
    model = Gated()
    want = model(x).asnumpy()
    prefetchd.offload(model, make_daemon(device_budget="64KiB"), lookahead=1, auto_fetch=True)
    np.testing.assert_array_equal(model(x).asnumpy(), want)          # recording pass
    for fail in (False, True):
        gate.clear()
        entered.clear()
        outcome = {}

        def call(name, fail):
            try:
                outcome[name] = model(x, fail).asnumpy()
            except ValueError as e:
                outcome[name] = e
        first = threading.Thread(target=call, args=("first", fail), name="first", daemon=True)
        first.start()
        deadline = time.monotonic() + 30
        while ("first", 1) not in entered:
            assert time.monotonic() < deadline, f"the first pass never reached its second block: {outcome}"
            time.sleep(0.01)
        second = threading.Thread(target=call, args=("second", False), name="second", daemon=True)
        second.start()
        time.sleep(0.5)
        assert all(name == "first" for name, _ in entered), f"the second pass ran beside the first: {entered}"
        gate.set()
        first.join(30)
        second.join(30)
        assert not first.is_alive() and not second.is_alive(), "a pass hung"
        if fail:
            assert isinstance(outcome["first"], ValueError)
        else:
            np.testing.assert_array_equal(outcome["first"], want)
        np.testing.assert_array_equal(outcome["second"], want)
    np.testing.assert_array_equal(model(x).asnumpy(), want)          # and the calling thread goes on


def test_offload_refuses_a_daemon_never_started_and_a_bad_lookahead(ms, store_dir):
    net = ms.nn.SequentialCell([ms.nn.Dense(8, 8) for _ in range(2)])
    with pytest.raises(prefetchd.ShutdownError, match="not started"):
        prefetchd.offload(net, prefetchd.Daemon(device_budget="1MiB", store_dir=store_dir))
    with prefetchd.Daemon(device_budget="1MiB", store_dir=store_dir) as daemon:
        for bad in (-1, 1.5, "2", True):
            with pytest.raises(ValueError, match="lookahead must be an int >= 0"):
                prefetchd.offload(net, daemon, lookahead=bad)
        assert not daemon.names()             # nothing was registered by a refused offload


def test_a_lookahead_beyond_the_models_cells_is_lowered_to_what_it_can_use(make_daemon, reference, caplog):
    """lookahead=10**18 planned units for it (every block split to its leaves, a unit share of
    0 bytes) and the handle reported 10**18 while at most n-1 units can follow the one computing."""
    x, want, resident = reference
    holders = sum(1 for _, c in resident.cells_and_names() if list(c.get_parameters(expand=False)))
    caplog.set_level("WARNING", logger="prefetchd.hooks")
    model, handle, _ = offloaded(make_daemon, 0.5, lookahead=10 ** 18)
    assert handle.lookahead == holders - 1 == handle.stats()["lookahead"]
    assert f"lookahead {10 ** 18} is more than this model can use" in caplog.text
    table = handle.plan().format_table()
    assert f"(lookahead {holders - 1})" in table and str(10 ** 18) not in table    # planned for what it uses
    np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_a_route_the_recording_pass_did_not_take_becomes_the_trace(ms, store_dir):
    """MoE: the recording pass routes to experts 0-1, later passes to 2-5. Those were never in
    the trace, so they were never prefetched: every pass missed all four. The first pass
    that runs them is the trace from then on."""
    nn = ms.nn

    class MoE(nn.Cell):
        def __init__(self):
            super().__init__()
            self.experts = nn.CellList([nn.SequentialCell([nn.Dense(64, 256), nn.Dense(256, 64)])
                                        for _ in range(6)])
            self.route = (0, 1)

        def construct(self, x):
            out = x
            for e in self.route:           # a router's choice, made on the host
                out = out + self.experts[e](x)
            return out

    ms.set_seed(0)
    model = MoE()
    model.set_train(False)
    x = ms.Tensor(np.ones((2, 64), np.float32))
    model.route = (2, 3, 4, 5)
    want = model(x).asnumpy()
    model.route = (0, 1)
    with prefetchd.Daemon(device_budget="700KiB", store_dir=store_dir) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        model(x)                                        # recorded with experts 0 and 1
        names = [u.name for u in handle.units]
        model.route = (2, 3, 4, 5)
        for i in range(3):
            np.testing.assert_array_equal(model(x).asnumpy(), want, err_msg=f"pass {i}")
        assert handle.stats()["retraces"] == 1
        assert [names[i] for i in handle.trace[1:]] == [f"experts.{e}.{d}" for e in (2, 3, 4, 5) for d in (0, 1)]
        handle.close()


def test_an_interrupt_as_the_recording_pass_ends_leaves_no_timing_thread(make_daemon, reference, monkeypatch):
    """A Ctrl-C while the recording pass's estimate was worked out (before its clock was
    stopped) left that clock's thread waiting for good: one leaked per interrupted pass."""
    from prefetchd.cost import estimate
    x, want, _ = reference
    before = fence_clocks()
    model, handle, daemon = offloaded(make_daemon, 0.3, lookahead=1)

    def interrupted():
        raise KeyboardInterrupt
    monkeypatch.setattr(estimate, "checksum_rate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        model(x)
    monkeypatch.undo()
    np.testing.assert_array_equal(model(x).asnumpy(), want)
    handle.close()
    assert_no_new_fence_clocks(before)
