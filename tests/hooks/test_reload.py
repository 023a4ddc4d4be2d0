"""prefetchd.load_param_into_net: a checkpoint loaded into a model already offloaded, the way
a user swaps in fine-tuned weights (mindspore.save_checkpoint / load_checkpoint files)."""
import threading

import numpy as np
import pytest

import prefetchd
from helpers import wait_until
from prefetchd import NotResidentError, PrefetchdError
from _block_net import UNIT_BLOCKS, Net


def _seeded(ms, seed):
    ms.set_seed(seed)
    return Net()


@pytest.fixture
def setup(ms, make_daemon, tmp_path):
    """(offloaded model, daemon, x, its outputs, a checkpoint of another model and its outputs)."""
    x = ms.Tensor(np.random.default_rng(1).standard_normal((4, 128), dtype=np.float32))
    old, new = _seeded(ms, 0), _seeded(ms, 7)
    path = str(tmp_path / "new.ckpt")
    ms.save_checkpoint(new, path)
    model = _seeded(ms, 0)
    daemon = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget=2 * UNIT_BLOCKS)
    prefetchd.offload(model, daemon, lookahead=1)
    model(x)
    return model, daemon, x, old(x).asnumpy(), path, new(x).asnumpy()


def test_a_checkpoint_loads_into_an_offloaded_model_and_stays_through_evictions(ms, setup):
    model, daemon, x, _, path, want = setup
    assert prefetchd.load_param_into_net(model, ms.load_checkpoint(path)) == ([], [])
    for _ in range(4):      # every unit is evicted and reloaded each pass (budget: 4 of 8 units)
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert daemon.snapshot()[1].writebacks > 0


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_a_float_value_of_another_width_is_converted_as_mindspores_own_load_does(ms, setup, dtype, caplog):
    """mindspore.load_param_into_net converts a float64 (or float16) value to a float32
    parameter, with a warning; ours refused it, so a checkpoint that loads into the resident
    model did not load into the offloaded one. strict_load=True refuses it, as MindSpore's."""
    model, _, x, before, path, _ = setup
    params = {name: ms.Parameter(ms.Tensor(value.asnumpy().astype(dtype)), name=name)
              for name, value in ms.load_checkpoint(path).items()}
    with pytest.raises(PrefetchdError, match=r"the value given is \(128, 128\) float"):
        prefetchd.load_param_into_net(model, params, strict_load=True)
    np.testing.assert_array_equal(model(x).asnumpy(), before)
    resident = _seeded(ms, 0)
    ms.load_param_into_net(resident, params)
    with caplog.at_level("WARNING", logger="prefetchd.hooks"):
        assert prefetchd.load_param_into_net(model, params) == ([], [])
    assert any("converted to the parameter's float32" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(model(x).asnumpy(), resident(x).asnumpy())


def test_mindspores_own_loader_is_refused_and_points_to_ours(ms, setup):
    model, _, x, before, path, _ = setup
    with pytest.raises(NotResidentError, match=r"prefetchd\.load_param_into_net"):
        ms.load_param_into_net(model, ms.load_checkpoint(path))
    np.testing.assert_array_equal(model(x).asnumpy(), before)


def test_names_the_net_lacks_or_the_dict_lacks_are_listed_and_strict_refuses_them(ms, setup):
    model, _, x, before, path, _ = setup
    params = ms.load_checkpoint(path)
    params = {k: v for k, v in params.items() if k.startswith("blocks.")}
    del params["blocks.2.fc.bias"]
    params["head.weight"] = ms.Tensor(np.zeros(3, np.float32))
    with pytest.raises(PrefetchdError, match=r"nothing loaded: 1 \('blocks.2.fc.bias'\) of the net's parameters "
                                             r"have no value in the dict; 1 \('head.weight'\) of the dict's "
                                             r"names are no parameter of the net$"):
        prefetchd.load_param_into_net(model, params, strict_load=True)
    np.testing.assert_array_equal(model(x).asnumpy(), before)
    assert prefetchd.load_param_into_net(model, params) == (["blocks.2.fc.bias"], ["head.weight"])
    weight = model.blocks[2].fc.weight
    with model._prefetchd.daemon.use([weight]):
        np.testing.assert_array_equal(weight.asnumpy(), params["blocks.2.fc.weight"].asnumpy())


@pytest.mark.parametrize("bad", ["shape", "dtype", "type", "managed"])
def test_a_wrong_value_is_refused_before_anything_is_written(ms, setup, bad):
    model, _, x, before, path, _ = setup
    params = ms.load_checkpoint(path)
    last = "blocks.7.fc.weight"           # the last one: every other would be written first
    if bad == "shape":
        params[last] = ms.Tensor(np.zeros((128, 64), np.float32))
        match = r"'blocks.7.fc.weight' is \(128, 128\) float32, the value given is \(128, 64\) float32"
    elif bad == "dtype":             # (MindSpore's own load converts float to float, int to int only)
        params[last] = ms.Tensor(np.zeros((128, 128), np.int32))
        match = r"the value given is \(128, 128\) int32"
    elif bad == "type":
        params[last] = [[0.0] * 128] * 128
        match = "not a Parameter, Tensor or numpy array"
    else:
        params[last] = model.blocks[7].fc.weight       # another managed tensor, not resident
        match = "is itself managed by prefetchd"
    with pytest.raises((PrefetchdError, TypeError), match=match):
        prefetchd.load_param_into_net(model, params)
    np.testing.assert_array_equal(model(x).asnumpy(), before)


def test_forwards_on_another_thread_see_the_old_weights_or_the_new_never_a_mix(ms, setup):
    model, _, x, before, path, want = setup
    params = ms.load_checkpoint(path)
    seen, errors, done = [], [], threading.Event()

    def forwards():
        try:
            while not done.is_set():
                seen.append(model(x).asnumpy())
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
    worker = threading.Thread(target=forwards)
    worker.start()
    try:
        while not seen:
            worker.join(0.01)
        prefetchd.load_param_into_net(model, params)
        count = len(seen)
        while len(seen) < count + 2 and worker.is_alive():
            worker.join(0.01)
    finally:
        done.set()
        worker.join(60)
    assert not errors and not worker.is_alive()
    kinds = ["old" if np.array_equal(s, before) else "new" if np.array_equal(s, want) else "mixed" for s in seen]
    assert "mixed" not in kinds and kinds[-1] == "new", kinds
    assert kinds == sorted(kinds, key=lambda k: k == "new"), kinds   # old ones, then new ones


def test_inside_a_forward_it_is_refused(ms, make_daemon, tmp_path):
    path = str(tmp_path / "c.ckpt")
    ms.save_checkpoint(_seeded(ms, 3), path)
    model, caught = _seeded(ms, 0), []

    def load_midway(cell, inputs):        # a hook of the model's fourth block: inside its forward
        try:
            prefetchd.load_param_into_net(model, ms.load_checkpoint(path))
        except PrefetchdError as e:
            caught.append(str(e))
    prefetchd.offload(model, make_daemon(device_budget=4 * UNIT_BLOCKS), lookahead=1)
    model.blocks[3].register_forward_pre_hook(load_midway)
    x = ms.Tensor(np.ones((2, 128), np.float32))
    model(x)
    assert caught and "refused inside this model's forward" in caught[0]
    np.testing.assert_array_equal(model(x).asnumpy(), _seeded(ms, 0)(x).asnumpy())   # nothing loaded


def test_a_model_that_is_not_offloaded_is_loaded_by_mindspore(ms, tmp_path):
    path = str(tmp_path / "c.ckpt")
    ms.save_checkpoint(_seeded(ms, 3), path)
    model = _seeded(ms, 0)
    assert prefetchd.load_param_into_net(model, ms.load_checkpoint(path)) == ([], [])
    np.testing.assert_array_equal(model.blocks[0].fc.weight.asnumpy(), _seeded(ms, 3).blocks[0].fc.weight.asnumpy())


def test_a_closed_offload_is_refused(ms, setup):
    model, _, _, _, path, _ = setup
    model._prefetchd.close()
    with pytest.raises(PrefetchdError, match="offload was closed"):
        prefetchd.load_param_into_net(model, ms.load_checkpoint(path))


class _RootFirst(Net):
    """A root weight (read by the construct itself) that parameters_and_names() lists first."""

    def __init__(self, ms):
        super().__init__()
        self.scale = ms.Parameter(ms.Tensor(np.full((128,), 0.5, np.float32)), name="scale")
        self.blocks = Net().blocks            # re-added: after `scale` in definition order

    def construct(self, x):
        return super().construct(x * self.scale)


def test_a_write_right_after_an_unpin_is_refused_before_the_scheduler_applies_it(ms, make_daemon, monkeypatch):
    """The refusal of a write outside a forward came from the scheduler thread, when it applied
    the last unpin: a write in between (mindspore.load_param_into_net right after a forward;
    CI saw it once) was taken for the root's `scale`, then refused at the first evicted block,
    leaving a model of neither checkpoint. Every unpin (a unit's release, the end of
    daemon.use) goes through Scheduler.submit; the scheduler is held back here so the window
    is wide."""
    from prefetchd.core.requests import Kind
    x = ms.Tensor(np.random.default_rng(1).standard_normal((4, 128), dtype=np.float32))
    model = _RootFirst(ms)
    want = model(x).asnumpy()
    daemon = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget=2 * UNIT_BLOCKS)
    prefetchd.offload(model, daemon, lookahead=1)
    model(x)
    # The forward's root unpin waits for its compute fence: under load it came after the use
    # block below, which then left `scale` pinned, and the write was rightly taken (CI, once).
    assert wait_until(lambda: daemon.status()["pinned"] == 0, timeout=30)
    scheduler = daemon._core
    unpin, hold, held = scheduler._requests[Kind.UNPIN], threading.Event(), threading.Event()

    def late_unpin(req):
        if hold.is_set():
            held.wait(10)
        unpin(req)
    monkeypatch.setitem(scheduler._requests, Kind.UNPIN, late_unpin)
    try:
        with daemon.use([model.scale]):
            hold.set()
        with pytest.raises(PrefetchdError, match=r"refused set_data.*'scale'"):
            model.scale.set_data(ms.Tensor(np.zeros(128, np.float32)))
    finally:
        held.set()
    np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_a_refused_write_outside_the_forward_changes_nothing(ms, make_daemon, tmp_path):
    """Writes outside a forward were taken while the weight happened to be resident (the
    root) and refused at the first evicted one: mindspore.load_param_into_net (or
    model.apply re-initialising) left new root weights beside old blocks, every later pass
    a model of neither, with no error after the first. Now every such write is refused."""
    x = ms.Tensor(np.random.default_rng(1).standard_normal((4, 128), dtype=np.float32))
    ms.set_seed(0)
    model = _RootFirst(ms)
    want = model(x).asnumpy()
    ms.set_seed(7)
    path = str(tmp_path / "new.ckpt")
    ms.save_checkpoint(_RootFirst(ms), path)
    assert [p.name for p in model.get_parameters()][0] == "scale"
    daemon = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget=2 * UNIT_BLOCKS)
    prefetchd.offload(model, daemon, lookahead=1)
    model(x)
    assert "device" in prefetchd.tier(model.scale)            # resident: the write was taken
    with pytest.raises(PrefetchdError, match=r"refused .*'scale'.*load_param_into_net"):
        ms.load_param_into_net(model, ms.load_checkpoint(path))
    with pytest.raises(PrefetchdError, match="refused"):
        model.scale.set_data(ms.Tensor(np.zeros(128, np.float32)))
    with pytest.raises(PrefetchdError, match="refused MindSpore op Assign"):      # a kernel's write
        ms.ops.assign(model.scale, ms.Tensor(np.zeros(128, np.float32)))
    for _ in range(2):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    with daemon.use([model.scale]):                            # where writes belong
        model.scale.set_data(ms.Tensor(np.ones(128, np.float32)))
    assert not np.array_equal(model(x).asnumpy(), want)



def _strict_root_first(ms, make_daemon, x, path):
    """A _RootFirst model (saved to `path` first) offloaded with strict=True after two passes,
    its daemon and its output."""
    model = _RootFirst(ms)
    want = model(x).asnumpy()
    ms.save_checkpoint(model, path)
    daemon = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget=2 * UNIT_BLOCKS)
    prefetchd.offload(model, daemon, lookahead=1, strict=True)
    for _ in range(2):
        np.testing.assert_array_equal(model(x).asnumpy(), want)
    return model, daemon, want


def test_under_strict_a_reload_leaves_the_next_pass_its_root_prefetched(ms, make_daemon, tmp_path):
    """The reload's daemon.use of each weight evicted the root the last pass had prefetched
    for the next: under strict=True the next forward raised NotResidentError at '<root>' (an
    outside probe, 3 runs in 5)."""
    x = ms.Tensor(np.random.default_rng(1).standard_normal((4, 128), dtype=np.float32))
    paths = [str(tmp_path / "first.ckpt"), str(tmp_path / "other.ckpt")]
    model, _, want = _strict_root_first(ms, make_daemon, x, paths[0])
    ms.set_seed(7)
    other = _RootFirst(ms)
    other.scale.set_data(ms.Tensor(np.full((128,), 1.5, np.float32)))
    ms.save_checkpoint(other, paths[1])
    wants = [want, other(x).asnumpy()]
    for i in range(1, 7):
        prefetchd.load_param_into_net(model, ms.load_checkpoint(paths[i % 2]))
        np.testing.assert_array_equal(model(x).asnumpy(), wants[i % 2])
    assert model._prefetchd.stats()["misses"] == 0


def test_under_strict_a_pass_that_raised_at_its_root_leaves_the_next_one_prefetched(ms, make_daemon, tmp_path):
    """A pass that raised prefetched nothing for the next: a strict=True raise at the root
    (here: the root evicted between passes) raised again at every later pass."""
    x = ms.Tensor(np.random.default_rng(1).standard_normal((4, 128), dtype=np.float32))
    model, daemon, want = _strict_root_first(ms, make_daemon, x, str(tmp_path / "m.ckpt"))
    assert wait_until(lambda: daemon.status()["pinned"] == 0, timeout=30)
    daemon.evict([model.scale]).result(30)
    with pytest.raises(NotResidentError, match=r"strict=True\): unit '<root>' was not prefetched"):
        model(x)
    for _ in range(3):
        np.testing.assert_array_equal(model(x).asnumpy(), want)


def _root_last(ms):
    """Blocks of raw Parameters, then a head weight the construct itself reads (the root
    unit's), listed last: a reload writes it last."""
    from mindspore import nn, ops

    rng = np.random.default_rng(3)

    def weight(shape, name):
        return ms.Parameter(ms.Tensor((rng.standard_normal(shape) * 0.05).astype(np.float32)), name=name)

    class RawBlock(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w1, self.w2 = weight((256, 1024), "w1"), weight((1024, 256), "w2")

        def construct(self, x):
            return x + ops.matmul(ops.relu(ops.matmul(x, self.w1)), self.w2)

    class RootLast(nn.Cell):
        def __init__(self):
            super().__init__()
            self.blocks = nn.CellList([RawBlock() for _ in range(6)])
            self.out_w = weight((256, 64), "out_w")

        def construct(self, x):
            for block in self.blocks:
                x = block(x)
            return ops.matmul(x, self.out_w)

    return RootLast()


def test_under_strict_a_reload_that_writes_the_root_weight_last_leaves_it_prefetched(ms, make_daemon):
    """The reload's last write leaves the root weight dirty; the reload's own loads then evict
    it, and its write-back was still under way when the next pass's start was prefetched: the
    prefetch counted as a hit, the drop followed, and the next forward raised at '<root>'
    (an outside probe's model, 2 runs in 4)."""
    x = ms.Tensor(np.random.default_rng(1).standard_normal((2, 16, 256)).astype(np.float32))
    model, reference = _root_last(ms), _root_last(ms)
    total = sum(p.nbytes for p in model.get_parameters())
    daemon = make_daemon(device_budget=total // 2)
    prefetchd.offload(model, daemon, lookahead=1, strict=True)
    for round_ in range(4):
        scaled = {p.name: p.asnumpy() * (1.5 if round_ % 2 == 0 else 1 / 1.5) for p in reference.get_parameters()}
        for p in reference.get_parameters():
            p.set_data(ms.Tensor(scaled[p.name]))
        prefetchd.load_param_into_net(model, scaled)
        for _ in range(2):
            np.testing.assert_array_equal(model(x).asnumpy(), reference(x).asnumpy())
    assert model._prefetchd.stats()["misses"] == 0


def test_a_load_that_fails_part_way_refuses_the_forwards_until_a_load_completes(ms, setup, native_faults):
    """Every write-back failing (ENOSPC) stops the load part-way: written weights are new,
    the rest old. Such a model used to run on silently, its outputs neither model's (an
    outside probe, with a full disk and with Ctrl-C). Its forwards are refused until the
    load, run again, writes what the failed one left."""
    model, daemon, x, _, path, want = setup
    params = ms.load_checkpoint(path)
    native_faults.inject_fault("write", "error", nth=1, count=100000, err=28)
    with pytest.raises(Exception) as failed:
        prefetchd.load_param_into_net(model, params)
    assert any("stopped after" in note for note in getattr(failed.value, "__notes__", [])), failed.value
    # Why the device filled up, and what to do: it pointed at use() and evict() before.
    assert "held because their write-back failed" in str(failed.value) and "ENOSPC" in str(failed.value)
    # A pass, a unit called alone, and a cell inside a unit (an outside probe's: it ran).
    for call in (lambda: model(x), lambda: model.blocks[0](x), lambda: model.blocks[0].fc(x)):
        with pytest.raises(PrefetchdError, match=r"stopped after [1-9]\d* of \d+ parameters .* refuses to run "
                                                 r"until a load_param_into_net that writes the"):
            call()
    assert daemon.status()["pinned"] == 0          # refused before a unit's hooks pinned it
    native_faults.clear_faults()
    daemon.flush()                                     # the write-backs that failed, done now
    assert prefetchd.load_param_into_net(model, params) == ([], [])
    for _ in range(3):
        np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_a_ctrl_c_right_after_the_first_write_still_refuses_the_forwards(ms, setup, monkeypatch):
    """The first parameter written, then Ctrl-C before the load noted it: the model ran on
    with one new weight among old ones (an outside probe, with a trace function raising
    KeyboardInterrupt as the first set_data returned)."""
    model, daemon, x, before, path, want = setup
    written = []

    def interrupted_after(param):
        def set_data(*args, **kwargs):       # (the class's, looked up now: it changes with residency)
            type(param).set_data(param, *args, **kwargs)
            written.append(param.name)
            raise KeyboardInterrupt
        return set_data
    for param in model.get_parameters():
        monkeypatch.setattr(param, "set_data", interrupted_after(param), raising=False)
    with pytest.raises(KeyboardInterrupt):
        prefetchd.load_param_into_net(model, ms.load_checkpoint(path))
    monkeypatch.undo()
    assert len(written) == 1
    with pytest.raises(PrefetchdError, match=r"stopped after 0 of \d+ parameters \(KeyboardInterrupt\)"):
        model(x)
    prefetchd.load_param_into_net(model, ms.load_checkpoint(path))
    np.testing.assert_array_equal(model(x).asnumpy(), want)


def test_a_load_over_a_damaged_stored_value_says_that_no_load_can_pass_it(ms, make_daemon, tmp_path, native_faults):
    """A weight is written in place, so its stored value is read first: one that fails its
    checksum fails every load again. The refusal told the user to run the load again."""
    x = ms.Tensor(np.random.default_rng(1).standard_normal((4, 128), dtype=np.float32))
    path = str(tmp_path / "new.ckpt")
    ms.save_checkpoint(_seeded(ms, 7), path)
    model = _seeded(ms, 0)
    daemon = make_daemon(device_budget=4 * UNIT_BLOCKS, host_budget=0)    # every load reads the disk
    prefetchd.offload(model, daemon, lookahead=0)       # no prefetch to bring it back meanwhile
    model(x).asnumpy()            # compute done: the evict frees the block (else a load reclaims it)
    damaged = next(p.name for p in model.get_parameters() if p.name.startswith("blocks.0."))
    native_faults.inject_fault("read", "bitflip", nth=1, count=100000, key_contains=damaged)
    daemon.evict([damaged]).result(10)
    with pytest.raises(prefetchd.errors.IntegrityError) as failed:
        prefetchd.load_param_into_net(model, ms.load_checkpoint(path))
    note = " ".join(getattr(failed.value, "__notes__", []))
    assert "stored value is damaged" in note and "stage the checkpoint again" in note, note


def test_a_load_that_cannot_record_itself_in_the_store_loads_nothing_and_says_why(ms, setup):
    """A load marks the store before its first write (staging/load_markers.py: a crash during
    it must be seen by the next process); a store where the mark cannot be made refuses the
    load whole, naming the store, and the model keeps its weights."""
    import os
    from prefetchd.errors import StorageError
    from prefetchd.staging import load_markers
    model, daemon, x, before, path, want = setup
    store = daemon.config.store_dir
    marker = load_markers._path(store, [p.name for p in model.get_parameters()])
    os.mkdir(marker)                   # a rename cannot replace a directory
    with pytest.raises(StorageError, match=rf"refused, nothing loaded: it cannot record the load in the store {store}"):
        prefetchd.load_param_into_net(model, ms.load_checkpoint(path))
    np.testing.assert_array_equal(model(x).asnumpy(), before)
    os.rmdir(marker)
    assert not [n for n in os.listdir(store) if n.startswith(".pfd-load-")]     # nor a file half-made
    assert prefetchd.load_param_into_net(model, ms.load_checkpoint(path)) == ([], [])
    np.testing.assert_array_equal(model(x).asnumpy(), want)
    assert not [n for n in os.listdir(store) if n.startswith(".pfd-load-")]
