"""What happens around an offload: a closed handle, a second offload of the same model
or of its parameters, a closed daemon, a store_dir that is a file. Each must be a clear
Python error that leaves the first offload working, never a read of unmapped pages."""
import logging
import sys

import numpy as np
import pytest

import prefetchd
from prefetchd.errors import NotResidentError, PrefetchdError, ShutdownError, StorageError
from helpers import wait_until


def stack(ms, n=6, d=64):
    nn = ms.nn
    ms.set_seed(9)
    model = nn.SequentialCell([nn.SequentialCell([nn.Dense(d, d), nn.ReLU()]) for _ in range(n)])
    model.set_train(False)
    return model


def budget(model, fraction=0.6):
    return int(sum(p.nbytes for p in model.get_parameters()) * fraction)


@pytest.fixture
def x(ms):
    return ms.Tensor(np.random.default_rng(9).standard_normal((2, 64)).astype(np.float32))


def test_a_closed_handle_makes_the_model_refuse_to_run(ms, tmp_path, x):
    model = stack(ms)
    want = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s")) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        np.testing.assert_array_equal(model(x).asnumpy(), want)
        handle.close()
        handle.close()                                   # twice is fine
        with pytest.raises(PrefetchdError, match="its handle was closed"):
            model(x)


def test_graph_mode_set_after_offload_is_refused_by_name_and_pynative_runs_again(ms, tmp_path, x):
    """offload() refuses graph mode, but the mode can be set after it: MindSpore's compile then
    failed with "Unable to cast Python instance of type <class 'NoneType'> to C++ type
    'std::string'". Now the model, or a cell of it, called in graph mode says why."""
    model = stack(ms)
    want = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s")) as daemon:
        prefetchd.offload(model, daemon, lookahead=1)
        np.testing.assert_array_equal(model(x).asnumpy(), want)
        try:
            ms.set_context(mode=ms.GRAPH_MODE)
            with pytest.raises(PrefetchdError, match=r"'SequentialCell' was called in graph mode.*PYNATIVE_MODE"):
                model(x)
            with pytest.raises(PrefetchdError, match=r"'2\.0' was called in graph mode"):
                model[2][0](x)
            assert model[2][1](x).shape == x.shape          # a ReLU holds no weight: it compiles
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
        np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_a_second_offload_is_refused_and_the_first_keeps_working(ms, tmp_path, x):
    model = stack(ms)
    want = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "a")) as first, \
            prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "b")) as second:
        prefetchd.offload(model, first, lookahead=1)
        for daemon in (second, first):
            with pytest.raises(PrefetchdError, match="already offloaded to daemon"):
                prefetchd.offload(model, daemon, lookahead=1)
        assert second.names() == []
        other = ms.nn.SequentialCell([model[0], model[1]])   # a model built from offloaded blocks
        with pytest.raises(PrefetchdError, match=r"parameter '0\.0\.weight' is already managed"):
            prefetchd.offload(other, second)
        for _ in range(2):
            np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_a_model_on_a_closed_daemon_says_the_daemon_is_closed(ms, tmp_path, x):
    model = stack(ms)
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s"), name="mine") as daemon:
        prefetchd.offload(model, daemon, lookahead=1)
        model(x)
    with pytest.raises(ShutdownError, match="prefetchd daemon 'mine' is closed"):
        model(x)


def test_a_weight_read_after_its_daemon_closed_says_so_not_to_use_daemon_use(ms, tmp_path, x):
    model = stack(ms)
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s"), name="gone") as daemon:
        prefetchd.offload(model, daemon, lookahead=1)
        weight = model[0][0].weight
        daemon.evict([weight]).result(10)                # (no forward brings it back)
        assert "device" not in prefetchd.tier(weight)
        with pytest.raises(NotResidentError, match=r"daemon\.use"):     # open: daemon.use is the way
            weight.asnumpy()
    with pytest.raises(prefetchd.DaemonClosedError) as closed:
        weight.asnumpy()
    message = str(closed.value)
    assert "prefetchd daemon 'gone', which is closed" in message and "build the model again" in message
    assert "daemon.use" not in message
    assert prefetchd.tier(weight) == ()          # not ("host",): no replica is reachable through it


@pytest.mark.parametrize("tier", ["device", "Remote", None])
def test_a_tier_other_than_remote_or_host_is_refused_before_anything_is_registered(ms, tmp_path, x, tier):
    model = stack(ms)
    want = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s")) as daemon:
        with pytest.raises(ValueError, match=r"tier must be 'remote' \(files\) or 'host' \(RAM\)"):
            prefetchd.offload(model, daemon, lookahead=1, tier=tier)
        assert daemon.names() == []
    np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_checkpoint_false_is_no_checkpoint_and_another_value_is_refused_by_type(ms, tmp_path, x):
    """checkpoint=False was read as a path ("False: unknown checkpoint format"; an outside probe)."""
    model = stack(ms)
    want = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s")) as daemon:
        for bad in (1, 0, {"a": 1}):
            with pytest.raises(TypeError, match=r"checkpoint must be None, True .* or a \.ckpt/\.safetensors path"):
                prefetchd.offload(model, daemon, checkpoint=bad)
        prefetchd.offload(model, daemon, lookahead=1, checkpoint=False)
        np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_a_store_dir_that_is_a_file_is_refused_as_such(tmp_path):
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    with pytest.raises(StorageError, match="is not a directory"):
        prefetchd.Daemon(device_budget="1MiB", store_dir=str(path)).start()
    assert path.read_text() == "not a directory"


def checkpointed(ms, tmp_path, x):
    """A model saved to a checkpoint, and a fresh model of the same layout."""
    source = stack(ms)
    path = str(tmp_path / "model.ckpt")
    ms.save_checkpoint(source, path)
    return source(x).asnumpy(), path


@pytest.mark.parametrize("flaw", ["shape", "dtype", "missing"])
def test_a_checkpoint_that_does_not_match_the_model_registers_nothing(ms, tmp_path, x, flaw):
    want, good = checkpointed(ms, tmp_path, x)
    bad = {p.name: ms.Parameter(p.data.copy(), name=p.name) for p in stack(ms).get_parameters()}
    name = "3.0.weight"
    if flaw == "missing":
        del bad[name]
    else:
        values = bad[name].asnumpy()
        values = values.reshape(-1) if flaw == "shape" else values.astype(np.float16)
        bad[name] = ms.Parameter(ms.Tensor(values), name=name)
    ms.save_checkpoint([{"name": k, "data": v} for k, v in bad.items()], str(tmp_path / "bad.ckpt"))
    model = stack(ms)
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s")) as daemon:
        with pytest.raises(PrefetchdError if flaw == "missing" else ValueError, match=name.replace(".", r"\.")):
            prefetchd.offload(model, daemon, lookahead=1, checkpoint=str(tmp_path / "bad.ckpt"))
        assert daemon.names() == []
        prefetchd.offload(model, daemon, lookahead=1, checkpoint=good)     # a retry with the right file
        for _ in range(2):
            np.testing.assert_array_equal(model(x).asnumpy(), want)


@pytest.mark.parametrize("flaw", ["shape", "dtype", "missing"])
def test_a_checkpoint_file_that_does_not_fit_leaves_a_staged_store_as_it_was(ms, tmp_path, x, flaw):
    """The file was staged into the live store before it was checked: a refused offload left
    the bad shape or dtype in the store for good, and a file lacking a parameter was
    accepted with the older stage's tensor in its place."""
    want, good = checkpointed(ms, tmp_path, x)
    store = str(tmp_path / "s")
    with prefetchd.Daemon(device_budget="1MiB", store_dir=store) as daemon:      # the store holds `good`
        prefetchd.offload(stack(ms), daemon, lookahead=1, checkpoint=good)
    ms.set_seed(5)
    other = {p.name: ms.Parameter(p.data.copy(), name=p.name)
             for p in nn_stack_with_other_values(ms).get_parameters()}
    name = "3.0.weight"
    if flaw == "missing":
        del other[name]
    else:
        values = other[name].asnumpy()
        other[name] = ms.Parameter(ms.Tensor(values.reshape(-1) if flaw == "shape" else values.astype(np.float16)),
                                   name=name)
    bad = str(tmp_path / "bad.ckpt")
    ms.save_checkpoint([{"name": k, "data": v} for k, v in other.items()], bad)
    model = stack(ms)
    with prefetchd.Daemon(device_budget=budget(model), store_dir=store) as daemon:
        with pytest.raises(PrefetchdError if flaw == "missing" else ValueError, match=name.replace(".", r"\.")):
            prefetchd.offload(model, daemon, lookahead=1, checkpoint=bad)
        assert daemon.names() == []
        prefetchd.offload(model, daemon, lookahead=1, checkpoint=True)            # the store as staged
        for _ in range(2):
            np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_weights_written_back_into_a_store_open_from_it_later(ms, tmp_path, x):
    """Write-backs and placements stored their entries with no metadata: once a daemon had
    written new weights into a staged store (load_param_into_net, or offload() placing a
    model's own values), offload(checkpoint=True) and `serve --checkpoint-store` refused
    the store ("meta is not prefetchd tensor metadata")."""
    _, good = checkpointed(ms, tmp_path, x)
    store = str(tmp_path / "s")
    with prefetchd.Daemon(device_budget="1MiB", store_dir=store) as daemon:      # stage `good`
        prefetchd.offload(stack(ms), daemon, lookahead=1, checkpoint=good)
    newer = nn_stack_with_other_values(ms)
    want = newer(x).asnumpy()
    with prefetchd.Daemon(device_budget="1MiB", host_budget="0", store_dir=store) as daemon:
        model = stack(ms)
        prefetchd.offload(model, daemon, lookahead=1, checkpoint=True)
        prefetchd.load_param_into_net(model, {p.name: p for p in newer.get_parameters()})
        np.testing.assert_array_equal(model(x).asnumpy(), want)       # written back on eviction
    with prefetchd.Daemon(device_budget="1MiB", store_dir=store) as daemon:
        model = stack(ms)
        prefetchd.offload(model, daemon, lookahead=1, checkpoint=True)
        for _ in range(2):
            np.testing.assert_array_equal(model(x).asnumpy(), want)
    # A model's own values, placed in the store by offload(), open from it the same way.
    placed = str(tmp_path / "placed")
    with prefetchd.Daemon(device_budget="1MiB", store_dir=placed) as daemon:
        prefetchd.offload(newer, daemon, lookahead=1)
    with prefetchd.Daemon(device_budget="1MiB", store_dir=placed) as daemon:
        model = stack(ms)
        prefetchd.offload(model, daemon, lookahead=1, checkpoint=True)
        np.testing.assert_array_equal(model(x).asnumpy(), want)


def nn_stack_with_other_values(ms):
    ms.set_seed(5)
    return ms.nn.SequentialCell([ms.nn.SequentialCell([ms.nn.Dense(64, 64), ms.nn.ReLU()]) for _ in range(6)])


def test_a_second_model_with_the_same_names_does_not_restage_the_first_ones_weights(ms, tmp_path, x):
    """A second offload(checkpoint=file) into the same daemon staged its file over the
    tensors the first model streams, and was then refused as a double registration: the
    first model computed with a mix of both, and the store kept the second's values."""
    want, good = checkpointed(ms, tmp_path, x)
    other = str(tmp_path / "other.ckpt")
    ms.save_checkpoint(nn_stack_with_other_values(ms), other)
    first = stack(ms)
    with prefetchd.Daemon(device_budget=budget(first), host_budget="0", store_dir=str(tmp_path / "s")) as daemon:
        prefetchd.offload(first, daemon, lookahead=1, checkpoint=good)
        np.testing.assert_array_equal(first(x).asnumpy(), want)
        with pytest.raises(prefetchd.DoubleRegisterError, match="already registered"):
            prefetchd.offload(stack(ms), daemon, lookahead=1, checkpoint=other)
        for _ in range(3):                       # units reload from the store (no host cache)
            np.testing.assert_array_equal(first(x).asnumpy(), want)


def test_copying_weights_that_are_not_in_use_is_refused_not_a_crash(ms, tmp_path, x):
    """An optimizer's constructor clones every parameter; a clone reads every byte."""
    import copy
    model = stack(ms)
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s")) as daemon:
        prefetchd.offload(model, daemon, lookahead=1)
        model(x)
        with pytest.raises(NotResidentError):
            ms.nn.SGD(model.trainable_params(), learning_rate=0.1)
        evicted = next(p for p in model.get_parameters() if "device" not in prefetchd.tier(p))
        with pytest.raises(NotResidentError):
            copy.deepcopy(evicted)
        with daemon.use([evicted]):
            assert copy.deepcopy(evicted).asnumpy().shape == evicted.shape


def test_a_name_clash_midway_registers_nothing_and_the_suggested_rename_works(ms, tmp_path, x):
    """A second model sharing one parameter name (not its first) with the first: the clash
    used to surface midway, leaving the parameters before it managed, so the model died
    with SIGSEGV when run plainly and the suggested rename-and-retry was refused."""
    from prefetchd.errors import DoubleRegisterError
    first, second = stack(ms), stack(ms)
    second.update_parameters_name("second.")
    last = list(second.get_parameters())[-1]
    last.name = list(first.get_parameters())[-1].name          # the clash is the last name
    want = second(x).asnumpy()
    with prefetchd.Daemon(device_budget=budget(first), store_dir=str(tmp_path / "s")) as daemon:
        prefetchd.offload(first, daemon, lookahead=1)
        before = daemon.names()
        with pytest.raises(DoubleRegisterError, match="nothing was registered"):
            prefetchd.offload(second, daemon, lookahead=1)
        assert daemon.names() == before
        np.testing.assert_array_equal(second(x).asnumpy(), want)    # still plain memory
        last.name = "second.renamed"
        prefetchd.offload(second, daemon, lookahead=1)
        np.testing.assert_array_equal(second(x).asnumpy(), want)


def test_closing_the_handle_after_its_daemon_closed_mid_forward_still_closes_it(ms, store_dir):
    """A forward stopped midway (here a block raised) leaves its pins for the next pass to
    release; the daemon closed meanwhile (another thread): handle.close() raised ShutdownError
    from the unpin and left the handle open with no hooks, so the next call failed with a
    misleading NotResidentError instead of the 'handle was closed' refusal."""
    nn = ms.nn
    model = nn.SequentialCell([nn.Dense(64, 64) for _ in range(4)])
    x = ms.Tensor(np.ones((2, 64), np.float32))
    daemon = prefetchd.Daemon(device_budget="64KiB", store_dir=store_dir).start()
    handle = prefetchd.offload(model, daemon, lookahead=1)
    model(x)

    def fail(cell, inputs):
        raise RuntimeError("stopped midway")
    hook = model[2].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="stopped midway"):
        model(x)
    hook.remove()
    daemon.close()
    handle.close()
    assert handle.closed
    with pytest.raises(PrefetchdError, match="its handle was closed"):
        model(x)


@pytest.mark.parametrize("then", ["the daemon closed", "the model dropped unclosed"])
def test_a_pass_cut_short_leaves_no_thread_behind(ms, store_dir, then):
    """The cost model times a streamed pass's units on a thread (prefetchd.cost.fence_clock),
    which ends when the pass does. A pass cut short, then the daemon closed (and the handle
    never), or the model dropped without its handle closed (the daemon open), left that
    thread waiting for the next unit for good: one more per such model (outside probes
    counted them)."""
    import gc
    import threading
    nn = ms.nn
    model = nn.SequentialCell([nn.Dense(64, 64) for _ in range(4)])
    x = ms.Tensor(np.ones((2, 64), np.float32))
    daemon = prefetchd.Daemon(device_budget="64KiB", store_dir=store_dir).start()
    prefetchd.offload(model, daemon, lookahead=1)
    model(x)                                             # the recording pass
    before = set(threading.enumerate())                  # (other tests' clocks, ending on their own)

    def clocks():
        return [t for t in threading.enumerate() if t.name == "prefetchd-fence-clock" and t not in before]

    def fail(cell, inputs):
        raise RuntimeError("stopped midway")
    hook = model[2].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="stopped midway"):
        model(x)                                         # a streamed pass, timed, cut short
    hook.remove()
    assert clocks(), "the streamed pass was not timed: nothing tested"
    if then == "the daemon closed":
        daemon.close()
    else:
        del model, hook
        gc.collect()
    assert wait_until(lambda: not clocks(), timeout=3), clocks()
    daemon.close()


def test_two_parameters_of_one_model_with_one_name_are_refused_with_the_rename_that_works(ms, tmp_path, x):
    """A construct that slices its CellLists (`self.a[:n]`, as mindone's Phi does) has MindSpore
    rename their parameters from 0 in the resident pass, so two of one model's parameters
    share a name. The refusal blamed another model ("close the handle of the model that has
    it"); it names the clash and the rename, which then streams."""
    nn = ms.nn

    class Two(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a = nn.CellList([nn.Dense(64, 64) for _ in range(3)])
            self.b = nn.CellList([nn.Dense(64, 64) for _ in range(3)])

        def construct(self, x):
            for layer in self.a[:3]:
                x = layer(x)
            for layer in self.b[:3]:
                x = layer(x)
            return x

    ms.set_seed(3)
    model = Two()
    want = model(x).asnumpy()                       # the slices rename: 'a.0.weight' -> '0.weight'
    names = [p.name for p in model.get_parameters()]
    assert len(set(names)) < len(names), names
    with prefetchd.Daemon(device_budget=budget(model, 0.5), store_dir=str(tmp_path / "s")) as daemon:
        with pytest.raises(PrefetchdError, match=r"two of this model's parameters are named '0\.weight', at "
                                                 r"'a\.0\.weight' and 'b\.0\.weight' .* "
                                                 r"p\.name = path"):
            prefetchd.offload(model, daemon, lookahead=1)
        assert daemon.status()["tensors"] == 0
        for path, p in model.parameters_and_names():
            p.name = path
        prefetchd.offload(model, daemon, lookahead=1)
        for _ in range(3):
            np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_a_cell_set_again_in_its_construct_renames_and_the_refusal_says_where(ms, tmp_path, x):
    """NLLB-MoE's router runs `self.classifier = self.classifier.to_float(...)` in its
    construct: MindSpore names the weight 'classifier.weight' in both routers. The refusal
    gave only CellList slicing as the cause; it names both paths and this cause too, and
    the rename it gives streams (the construct's renames after offload() change nothing)."""
    nn = ms.nn

    class Router(nn.Cell):
        def __init__(self):
            super().__init__()
            self.classifier = nn.Dense(64, 64)

        def construct(self, x):
            self.classifier = self.classifier.to_float(ms.float32)
            return self.classifier(x)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.r1, self.r2 = Router(), Router()

        def construct(self, x):
            return self.r2(self.r1(x))

    ms.set_seed(4)
    model = Net()
    want = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=budget(model, 0.75), store_dir=str(tmp_path / "s")) as daemon:
        with pytest.raises(PrefetchdError) as refused:
            prefetchd.offload(model, daemon, lookahead=0)
        message = str(refused.value)
        assert "named 'classifier.weight', at 'r1.classifier.weight' and 'r2.classifier.weight'" in message
        assert "self.classifier = self.classifier.to_float(...)" in message, message
        for path, p in model.parameters_and_names():
            p.name = path
        prefetchd.offload(model, daemon, lookahead=0)
        for _ in range(3):
            np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_a_parameter_replaced_after_offload_is_computed_with_and_said_once(ms, tmp_path, x, caplog):
    """`cell.weight = Parameter(...)` after offload() (Speech2Text regrows its positions so in
    its forward): the cell computes with the new one, which prefetchd does not manage (in
    RAM, outside device_budget), while the old one still streamed. Nothing said so; now one
    warning at the end of the pass that replaced it, naming it and what to do."""
    resident, model = stack(ms), stack(ms)
    new = np.full((64, 64), 0.01, np.float32)
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s")) as daemon:
        prefetchd.offload(model, daemon, lookahead=1)
        model(x)
        caplog.set_level(logging.WARNING, logger="prefetchd.hooks")
        for net in (resident, model):
            net[2][0].weight = ms.Parameter(ms.Tensor(new), name="2.0.weight")
            net[4][0].has_bias, net[4][0].bias = False, None
        for _ in range(3):
            np.testing.assert_array_equal(model(x).asnumpy(), resident(x).asnumpy())
    said = [r.getMessage() for r in caplog.records if "after offload()" in r.getMessage()]
    assert len(said) == 2, said                  # once each, not once a pass
    assert "'2.0.weight' was replaced by a Parameter prefetchd does not manage (16384 bytes" in said[0], said
    assert "'4.0.bias' was set to None" in said[1], said


def test_cells_replaced_after_offload_and_a_closed_daemon_are_named(ms, tmp_path, x, monkeypatch):
    """auto_mixed_precision after offload() rebuilds cells, copying their hooks: the next
    forward raised a bare KeyError. And a model whose daemon closed was called "still in use"
    when offloaded again."""
    # auto_mixed_precision writes rewritten_network/ into the cwd, and puts mindspore/nn/layer
    # first on sys.path (MindSpore 2.10), where its math.py shadows the standard library's
    # for every later import and child process: both are undone after the test.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    model = stack(ms)
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s")) as daemon:
        prefetchd.offload(model, daemon, lookahead=1)
        model(x)
        ms.amp.auto_mixed_precision(model, "O1")
        with pytest.raises(PrefetchdError, match="copied or replaced after offload"):
            model(x)
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "t")) as daemon:
        with pytest.raises(PrefetchdError, match=r"daemon 'default' \(which is closed"):
            prefetchd.offload(model, daemon, lookahead=1)


def test_offloading_what_is_not_a_cell_says_so(ms, tmp_path):
    """offload(mindspore.jit(model)) failed with "'function' object has no attribute
    'get_parameters'"."""
    model = stack(ms)
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "s")) as daemon:
        with pytest.raises(TypeError, match=r"takes a mindspore\.nn\.Cell.*mindspore\.jit\(model\) returns a function"):
            prefetchd.offload(ms.jit(model), daemon)
        with pytest.raises(TypeError, match="not int"):
            prefetchd.offload(5, daemon)


def test_a_forward_that_raised_lets_go_of_its_pins_for_the_next_model(ms, tmp_path, x):
    """A forward that raised in a block kept the root and the unit pinned until the same
    model's next forward: a second model in the daemon failed every call for want of room."""
    nn = ms.nn

    class Raising(nn.Cell):
        def __init__(self):
            super().__init__()
            self.dense = nn.Dense(64, 64)

        def construct(self, x):
            if x.shape[0] == 3:
                raise ValueError("bad batch")
            return self.dense(x)
    ms.set_seed(2)
    a = nn.SequentialCell([Raising() for _ in range(4)] + [nn.Dense(64, 768)])   # a large head: root
    b = stack(ms, n=4)
    b.update_parameters_name("b.")
    want_a, want_b = a(x).asnumpy(), b(x).asnumpy()
    with prefetchd.Daemon(device_budget=300_000, store_dir=str(tmp_path / "s")) as daemon:
        prefetchd.offload(a, daemon, lookahead=1)
        prefetchd.offload(b, daemon, lookahead=1)
        np.testing.assert_array_equal(a(x).asnumpy(), want_a)
        with pytest.raises(ValueError, match="bad batch"):
            a(ms.Tensor(np.zeros((3, 64), np.float32)))
        assert wait_until(lambda: daemon.status()["pinned"] == 0, 5), daemon.status()["pinned"]
        for _ in range(2):
            np.testing.assert_array_equal(b(x).asnumpy(), want_b)
        np.testing.assert_array_equal(a(x).asnumpy(), want_a)


@pytest.mark.parametrize("holder", ["list", "tuple", "dict"])
def test_blocks_in_a_plain_list_are_named_in_a_warning(ms, tmp_path, x, caplog, holder):
    """MindSpore does not list the parameters of cells kept in a plain list: offload() left
    ~all of such a model's weights resident, outside the budget, and said nothing."""
    nn = ms.nn

    class Listed(nn.Cell):
        def __init__(self):
            super().__init__()
            blocks = [nn.Dense(64, 64) for _ in range(3)]
            self.blocks = {"a": blocks[0], "b": blocks[1], "c": blocks[2]} if holder == "dict" else \
                (tuple(blocks) if holder == "tuple" else blocks)
            self.head = nn.Dense(64, 8)

        def construct(self, x):
            for block in (self.blocks.values() if holder == "dict" else self.blocks):
                x = block(x)
            return self.head(x)
    model = Listed()
    want = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=1 << 20, store_dir=str(tmp_path / "s")) as daemon:
        with caplog.at_level("WARNING", logger="prefetchd.hooks"):
            prefetchd.offload(model, daemon, lookahead=1)
        assert f"'blocks' holds 3 cells with parameters in a plain {holder}" in caplog.text
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    caplog.clear()
    with prefetchd.Daemon(device_budget=1 << 20, store_dir=str(tmp_path / "t")) as daemon:
        with caplog.at_level("WARNING", logger="prefetchd.hooks"):
            prefetchd.offload(stack(ms), daemon, lookahead=1)                # a CellList: no warning
        assert "plain" not in caplog.text


def test_mindspore_jit_of_an_offloaded_model_is_refused_outside_its_forward(ms, tmp_path, x):
    """`mindspore.jit(model)(x)` runs the model's graph without Cell.__call__, so without
    prefetchd's hooks: it read weights not resident, unmapped, and the process died
    (SIGSEGV). Refused now; inside daemon.use() of every weight it runs, and equals."""
    model = stack(ms)
    expected = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "j")) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        model(x)
        @ms.jit
        def calls_a_block(a):          # a function: the cells its code names count
            return model[1](a)

        @ms.jit(capture_mode="trace")  # traced, it read unmapped weights (SIGSEGV), and a
        def traces_the_model(a):       # gradient of it came back all zeros
            return model(a).sum()
        for compiled in (ms.jit(model), ms.jit(model[1]), ms.jit(model, capture_mode="trace"),
                         calls_a_block, traces_the_model, ms.grad(traces_the_model)):
            with pytest.raises(PrefetchdError, match="runs its graph without the cell's hooks"):
                compiled(x)
        # Refused inside the gradient's forward, MindSpore kept recording every later op (in-place
        # writes then made out of place: a tensor sharing another's memory missed its writes).
        from mindspore.common.api import _pynative_executor
        assert not _pynative_executor.requires_grad()
        np.testing.assert_array_equal(model(x).asnumpy(), expected)    # the model is untouched
        first = model[0]
        with daemon.use([p for p in first.get_parameters()]):
            np.testing.assert_array_equal(ms.jit(first)(x).asnumpy(), first(x).asnumpy())
        handle.close()
        with pytest.raises(PrefetchdError, match="runs its graph without the cell's hooks"):
            ms.jit(model)(x)


@pytest.mark.parametrize("optimizer", ["SGD", "Adam"])
def test_an_optimizer_over_offloaded_weights_stepped_outside_daemon_use_is_refused(ms, tmp_path, x, optimizer):
    """An nn optimizer built over the model's parameters (the usual fine-tuning setup) is a
    cell of its own whose construct is @jit: stepped outside daemon.use, its graph read the
    weights not resident, unmapped, and the process died (SIGSEGV; an outside probe). Refused
    now, weights untouched; inside daemon.use the step runs and equals the resident one's."""
    def make(params):
        return ms.nn.SGD(params, learning_rate=0.1) if optimizer == "SGD" else ms.nn.Adam(params, learning_rate=0.1)
    twin, model = stack(ms), stack(ms)
    resident = [p.asnumpy() for p in model.get_parameters()]
    opt, twin_opt = make(model[1].trainable_params()), make(twin[1].trainable_params())
    grads = tuple(ms.Tensor(np.full(p.shape, 0.5, np.float32)) for p in model[1].trainable_params())
    twin_opt(grads)
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "o")) as daemon:
        prefetchd.offload(model, daemon, lookahead=1)
        model(x)
        assert prefetchd.tier(model[1][0].weight) != "device"

        @ms.jit
        def step(g):                   # a function naming the optimizer
            return opt(g)
        for call in (opt, step):
            with pytest.raises(PrefetchdError, match=rf"over this {optimizer} runs its graph on weights of an "
                                                     r"offloaded model that are not resident \('1\.0\.weight'"):
                call(grads)
        params = list(model.get_parameters())
        for p, r in zip(params, resident):
            with daemon.use([p]):
                assert np.array_equal(p.asnumpy(), r), p.name          # the refused steps wrote nothing
        with daemon.use(model[1].trainable_params()):
            opt(grads)
        for p, q in zip(params, twin.get_parameters()):
            with daemon.use([p]):
                np.testing.assert_array_equal(p.asnumpy(), q.asnumpy())
        np.testing.assert_array_equal(model(x).asnumpy(), twin(x).asnumpy())


@pytest.mark.parametrize("write", ["set_data_transposed", "set_data_wider", "assign_value_wider",
                                   "assign_value_int32", "assign_value_float16", "set_dtype"])
def test_a_write_that_changes_a_weights_layout_is_refused_before_it_changes_anything(ms, tmp_path, x, write):
    """The refusal came after MindSpore had applied the write: the Parameter kept the new
    shape in memory the daemon does not manage, and the model computed something else; a
    write of the same byte count was even taken, reshaped into the old layout. And
    set_dtype on a weight not resident was a SIGSEGV."""
    model = stack(ms)
    expected = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "w")) as daemon:
        prefetchd.offload(model, daemon, lookahead=1)
        weight = model[2][0].weight                               # (64, 64) float32
        values = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
        do = {"set_data_transposed": lambda: weight.set_data(ms.Tensor(values.reshape(128, 32))),
              "set_data_wider": lambda: weight.set_data(ms.Tensor(np.zeros((64, 96), np.float32))),
              "assign_value_wider": lambda: weight.assign_value(ms.Tensor(np.zeros((96, 64), np.float32))),
              # A Parameter's assign_value takes the value's dtype (its set_data casts).
              "assign_value_int32": lambda: weight.assign_value(ms.Tensor(values.astype(np.int32))),
              "assign_value_float16": lambda: weight.assign_value(ms.Tensor(values.astype(np.float16))),
              "set_dtype": lambda: weight.set_dtype(ms.float16)}[write]
        with pytest.raises((PrefetchdError, NotResidentError)):     # not resident: refused as a read
            do()
        with daemon.use([weight]):
            with pytest.raises(PrefetchdError, match="must keep its shape and dtype.*Nothing was changed"):
                do()
            assert tuple(weight.shape) == (64, 64) and weight.dtype == ms.float32
        np.testing.assert_array_equal(model(x).asnumpy(), expected)


def test_copying_an_offloaded_model_inside_use_says_it_cannot_be_copied(ms, tmp_path, x):
    """Outside use() the weights refuse a copy; inside it deepcopy went on into prefetchd's hooks
    and failed with "cannot pickle 'prefetchd._native.Arena'" (or '...Block')."""
    import copy
    import pickle
    model = stack(ms)
    expected = model(x).asnumpy()
    with prefetchd.Daemon(device_budget=int(sum(p.nbytes for p in model.get_parameters()) * 2),
                          store_dir=str(tmp_path / "c")) as daemon:
        prefetchd.offload(model, daemon, lookahead=1)
        with daemon.use(list(model.get_parameters())):
            with pytest.raises(PrefetchdError, match="offloaded model cannot be copied or pickled"):
                copy.deepcopy(model)
            with pytest.raises(PrefetchdError, match="cannot be copied or pickled"):
                pickle.dumps(model._prefetchd)
        np.testing.assert_array_equal(model(x).asnumpy(), expected)


def test_mindspore_jit_of_a_cell_whose_sub_cells_are_hooked_runs_inside_use(ms, tmp_path, x):
    """A block split into units has prefetchd's hooks on its sub-cells (a model's blocks do,
    at any budget), and MindSpore 2.10 compiles a graph's sub-cells' forward hooks into it:
    `mindspore.jit(block)(x)` inside `daemon.use` of its weights failed ("Unsupported
    statement 'Import'"), and `mindspore.jit(model)` inside use of every weight raised the
    hooks' refusal at trace time (probe J). The hooks are out of the graph now, and back
    for the passes after."""
    nn = ms.nn

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Dense(64, 64), nn.Dense(64, 64), nn.Dense(64, 64)

        def construct(self, a):
            return a + self.fc3(ms.ops.relu(self.fc2(ms.ops.relu(self.fc1(a)))))

    def build():
        ms.set_seed(5)
        model = nn.SequentialCell([Block() for _ in range(4)])
        model.set_train(False)
        return model

    model = build()
    expected, expected_block = model(x).asnumpy(), model[1](x).asnumpy()
    expected_two = model[2](model[1](x)).asnumpy()
    one_block = sum(p.asnumpy().nbytes for p in model[1].get_parameters())
    for fraction in (1.6, 6.0):              # blocks split into units; blocks as units, all fit
        model = build()
        block = model[1]
        with prefetchd.Daemon(device_budget=int(fraction * one_block), store_dir=str(tmp_path / f"{fraction}")) as daemon:
            handle = prefetchd.offload(model, daemon, lookahead=1)
            model(x)
            if fraction < 2:
                assert len([u for u in handle.plan().units if u.name.startswith("1.")]) > 1   # split
                with daemon.use(list(block.get_parameters())):
                    np.testing.assert_array_equal(ms.jit(block)(x).asnumpy(), expected_block)
                with pytest.raises(PrefetchdError, match="runs its graph without the cell's hooks"):
                    ms.jit(block)(x)              # outside use: still refused
            else:
                first, second = model[1], model[2]

                @ms.jit
                def two_blocks(a):               # two cells of one model: its turn taken once
                    return second(first(a))
                with daemon.use(list(model.get_parameters())):
                    np.testing.assert_array_equal(ms.jit(model)(x).asnumpy(), expected)
                    np.testing.assert_array_equal(two_blocks(x).asnumpy(), expected_two)
            for _ in range(2):                    # the hooks are back: it streams as before
                np.testing.assert_array_equal(model(x).asnumpy(), expected)
            assert handle.stats()["misses"] == 0 and handle.stats()["resyncs"] == 0
            handle.close()


def test_a_forward_on_another_thread_waits_for_a_jit_call_inside_use(ms, tmp_path, x, monkeypatch):
    """While a jit call inside `daemon.use` had the model's hooks out of their tables, the
    model's own pre-hook was out too: a forward on another thread took no turn and ran
    without hooks (NotResidentError on a weight not resident; probe K). The model's
    pre-hook stays now, and that forward waits for the jit call."""
    import contextlib
    import threading
    import time
    from prefetchd.hooks import jit_calls
    model = stack(ms)
    expected = model(x).asnumpy()
    block = model[2]
    events = []
    hidden = jit_calls._out_of_tables

    @contextlib.contextmanager
    def slow_hidden(*args):
        with hidden(*args):
            events.append("hidden")
            started.set()
            time.sleep(0.5)              # the other thread's forward starts meanwhile
            yield
        events.append("restored")
    monkeypatch.setattr(jit_calls, "_out_of_tables", slow_hidden)
    started = threading.Event()
    result = {}

    def forward():
        started.wait(30)
        try:
            result["equal"] = np.array_equal(model(x).asnumpy(), expected)
        except Exception as e:          # noqa: BLE001 - reported below
            result["error"] = repr(e)
        events.append("forward done")

    with prefetchd.Daemon(device_budget=budget(model), store_dir=str(tmp_path / "t")) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        model(x)
        other = threading.Thread(target=forward)
        other.start()
        @ms.jit
        def twice(a):                    # a function naming the block: the block's hooks go too
            return block(a) * 2
        with daemon.use(list(block.get_parameters())):
            twice(x).asnumpy()
        other.join(60)
        assert result == {"equal": True}, result
        assert events == ["hidden", "restored", "forward done"], events
        handle.close()


def test_a_forward_that_fails_inside_mindspore_unpins_its_weights_for_the_other_models(ms, make_daemon):
    """MindSpore raises an op's error (here shapes that do not broadcast) at the next op that
    uses its result: the compute fence prefetchd puts behind the pass. The unpin after that
    fence never went out: the failed model's weights stayed pinned, and every forward of
    another model on the daemon failed with BudgetError (an outside probe's two served models)."""
    nn = ms.nn

    class TwoInputs(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w, self.emb = nn.Dense(4, 8), nn.Embedding(20000, 8)

        def construct(self, x, ids):
            return self.w(x) + self.emb(ids)

    ms.set_seed(3)
    first, second = TwoInputs(), TwoInputs()
    second.update_parameters_name("second.")
    want = second(ms.Tensor(np.ones((1, 2, 4), np.float32)), ms.Tensor(np.ones((1, 2), np.int32))).asnumpy()
    daemon = make_daemon(device_budget="1MiB")           # one model's weights at a time
    prefetchd.offload(first, daemon)
    prefetchd.offload(second, daemon)
    ids = ms.Tensor(np.ones((1, 2), np.int32))
    for model in (first, second, first):                 # past the recording passes
        model(ms.Tensor(np.ones((1, 2, 4), np.float32)), ids).asnumpy()
    with pytest.raises(ValueError, match="broadcast"):
        first(ms.Tensor(np.ones((1, 3, 4), np.float32)), ids).asnumpy()
    assert wait_until(lambda: daemon.status()["pinned"] == 0, timeout=30), daemon.status()["pinned"]
    np.testing.assert_array_equal(second(ms.Tensor(np.ones((1, 2, 4), np.float32)), ids).asnumpy(), want)
    assert first(ms.Tensor(np.ones((1, 2, 4), np.float32)), ids).shape == (1, 2, 8)
