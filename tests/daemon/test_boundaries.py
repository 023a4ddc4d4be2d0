"""Hostile input at the Daemon's boundary: refused at once with a reason, and the
daemon stays usable (each case here was accepted, hung or crashed before)."""
import concurrent.futures
import gc
import logging
import math
import threading
import time

import numpy as np
import pytest

from helpers import wait_until
from prefetchd import Daemon
from prefetchd.config import Config
from prefetchd.errors import ConfigError
from prefetchd.errors import BudgetError, DoubleRegisterError, SchedulerWaitError, UnknownTensorError

MiB = 1 << 20


def values(seed, n=MiB // 4):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def still_usable(daemon, make_param):
    """The daemon answers tensors(), flush() and a round trip after the refusal."""
    daemon.tensors()
    daemon.flush().result(10)
    h = daemon.register(make_param(values(99), "after"), tier="remote")
    with daemon.use(h):
        np.testing.assert_array_equal(h.target.asnumpy(), values(99))


@pytest.mark.parametrize("name", [123, b"bytes", 1.5])
def test_a_name_that_is_not_a_string_is_refused(daemon, make_param, name):
    with pytest.raises(TypeError, match="name must be a str"):
        daemon.register(make_param(values(1), "w"), name)
    assert daemon.names() == []
    still_usable(daemon, make_param)


@pytest.mark.parametrize("name, why", [("bad\ud800name", "UTF-8"), ("x" * 1025, "at most"),
                                       ("", "empty"), ("nul\0", "NUL")])
def test_a_name_the_store_cannot_hold_is_refused_before_anything_moves(daemon, make_param, name, why):
    with pytest.raises(ValueError, match=why):
        daemon.register(make_param(values(1), "w"), name, tier="remote")
    assert daemon.names() == [] and daemon.status()["states"]["storing"] == 0
    still_usable(daemon, make_param)


@pytest.mark.parametrize("thing", [np.zeros(4, np.float32), [1.0, 2.0], None])
def test_register_of_a_non_tensor_is_refused(daemon, make_param, thing):
    with pytest.raises(TypeError, match="mindspore Tensor or Parameter"):
        daemon.register(thing, "x")
    still_usable(daemon, make_param)


@pytest.mark.parametrize("priority", ["x", None, math.nan, math.inf, True, np.bool_(True), 10 ** 400])
def test_a_bad_priority_is_refused_on_the_callers_thread(daemon, make_param, priority):
    h = daemon.register(make_param(values(1), "w"), tier="remote")
    with pytest.raises(TypeError, match="priority"):
        daemon.prefetch(h, priority=priority)
    with pytest.raises(TypeError, match="priority"):
        daemon.pin(h, priority=priority)
    still_usable(daemon, make_param)


@pytest.mark.parametrize("deadline", ["soon", math.nan, math.inf, -math.inf, 10 ** 400])
def test_a_bad_deadline_is_refused(daemon, make_param, deadline):
    h = daemon.register(make_param(values(1), "w"), tier="remote")
    with pytest.raises(TypeError, match="deadline"):
        daemon.prefetch(h, deadline=deadline)


def test_numpy_numbers_are_priorities_and_deadlines(daemon, make_param):
    h = daemon.register(make_param(values(1), "w"), tier="remote")
    daemon.prefetch(h, priority=np.int64(3), deadline=np.float64(time.monotonic() + 60)).result(10)
    daemon.pin(h, priority=np.float32(1.5)).result(10)
    daemon.unpin(h)


def test_a_listener_that_is_not_callable_is_refused(daemon):
    with pytest.raises(TypeError, match="int is not callable"):
        daemon.add_listener(5)


def test_watermarks_below_the_pinned_bytes_are_refused(make_daemon, make_param):
    daemon = make_daemon(device_budget=8 * MiB)
    hs = [daemon.register(make_param(values(i), f"t{i}"), tier="remote") for i in range(3)]
    with daemon.use(hs):
        with pytest.raises(BudgetError, match="pinned"):
            daemon.set_watermarks(MiB, MiB // 2).result(10)
        assert daemon.status()["device"]["high_watermark"] > 3 * MiB
    daemon.set_watermarks(MiB + 64 * 1024).result(10)     # unpinned now: fine
    still_usable(daemon, make_param)


def test_a_use_of_more_than_fits_at_once_is_refused_as_a_set(make_daemon, make_param):
    """Three 1 MiB tensors under a 2.4 MiB watermark: refused naming the set and its bytes
    (the pin named one tensor of it, and 'N bytes are pinned', which were its own)."""
    daemon = make_daemon(device_budget=int(2.5 * MiB))
    hs = [daemon.register(make_param(values(i), f"t{i}"), tier="remote") for i in range(3)]
    with pytest.raises(BudgetError, match=r"daemon\.use\(\[\.\.\.\]\) of 3 tensors needs \d+ bytes on "
                                          r"the device at once; the high watermark is \d+ bytes"):
        with daemon.use(hs):
            pass
    assert daemon.status()["pinned"] == 0
    with daemon.use(hs[:2]):
        np.testing.assert_array_equal(hs[1].target.asnumpy(), values(1))
    still_usable(daemon, make_param)


def test_register_remote_of_a_missing_key_raises_unknown_tensor(daemon):
    with pytest.raises(UnknownTensorError, match="no tensor named 'nope'"):
        daemon.register_remote("nope", (4,), np.float32)


def test_a_dropped_daemon_is_shut_down_with_a_warning(store_dir, make_param, caplog):
    def scope():
        d = Daemon(store_dir=store_dir, device_budget="16MiB").start()
        d.register(make_param(values(1), "w"), tier="device")
        return d._thread
    thread = scope()
    with caplog.at_level(logging.WARNING, logger="prefetchd"):
        gc.collect()
        thread.join(15)
    assert not thread.is_alive(), "the scheduler thread of a dropped daemon kept running"
    assert any("dropped without close()" in r.getMessage() for r in caplog.records)
    assert not [t for t in threading.enumerate() if t.name.startswith("prefetchd-scheduler-default")]


@pytest.mark.parametrize("key, value, says", [
    ("io_block_size", 0, "multiple of 4 KiB"),
    ("io_block_size", "12345", "multiple of 4 KiB"),
    ("metrics_port", 70000, "at most 65535"),
    ("shutdown_timeout", "nan", "finite"),
    ("shutdown_timeout", "inf", "finite"),
    ("device_budget", "1000000TiB", "beyond any machine"),
    ("host_budget", "2PiB", "unknown unit 'PiB'"),
    ("verify_reads", "false", "always verified"),
    ("name", "a b/c", "letters, digits"),
    ("max_message_size", 10, "at least 1024"),
    ("huge_pages", "maybe", "true/false"),
    ("high_watermark", "nan", "(0, 1]"),
])
def test_every_config_value_is_checked_at_load_naming_the_key_and_source(key, value, says):
    env = {f"PREFETCHD_{key.upper()}": str(value)}
    with pytest.raises(ConfigError, match=f"{key}.*{says}.*PREFETCHD_{key.upper()}"
                       if key != "high_watermark" else f"{key}.*") as err:
        Config.load(env=env)
    assert key in str(err.value)
    with pytest.raises(ConfigError, match=key):
        Config.load(env={}, **{key: value})


@pytest.mark.parametrize("key", ["host_budget", "device_budget"])
@pytest.mark.parametrize("value", [1e20, float(2 ** 51)])
def test_a_float_size_has_the_same_limit_as_an_int(key, value):
    """A TOML `host_budget = 1e20` or an argument float was accepted past the 1 PiB limit."""
    with pytest.raises(ConfigError, match=f"{key}: {int(value)} bytes is beyond any machine"):
        Config.load(env={}, **{key: value})


def test_a_budget_beyond_the_machine_is_refused_at_start_with_the_numbers(store_dir):
    with pytest.raises(ConfigError, match="exceeds the .* that"):
        Daemon(store_dir=store_dir, device_budget="100TiB").start()


@pytest.mark.parametrize("request_of", ["prefetch", "evict", "flush", "pin", "use"])
def test_a_handle_of_another_daemons_tensor_is_refused(make_daemon, make_param, tmp_path, request_of):
    """Two copies of a model, one per daemon: the same names, different values. A handle of
    one daemon's tensor given to the other loaded the other's values into it, wrote its own
    over the other's store, or broke both daemons' books."""
    one, two = (make_daemon(name=n, store_dir=str(tmp_path / n)) for n in ("one", "two"))
    mine, theirs = make_param(np.full(1024, 1.0, np.float32), "w"), make_param(np.full(1024, 2.0, np.float32), "w")
    handle = one.register(mine, tier="remote")
    two.register(theirs, tier="remote")
    call = {"prefetch": lambda: two.prefetch(handle), "evict": lambda: two.evict(handle),
            "flush": lambda: two.flush([handle]), "pin": lambda: two.pin(handle),
            "use": lambda: two.use([handle]).__enter__()}[request_of]
    with pytest.raises(UnknownTensorError, match="'w' is not registered with daemon 'two': its handle belongs"):
        call()
    with one.use([handle]):
        assert (mine.asnumpy() == 1.0).all()
    with two.use([theirs]):
        assert (theirs.asnumpy() == 2.0).all()


@pytest.mark.parametrize("shape, dtype, target, error, says", [
    ((1024,), "float32", "numpy", TypeError, "target must be a mindspore Tensor"),
    ((-2, -512), "float32", None, ValueError, "shape must be a sequence of non-negative integers"),
    ((2.0, 512), "float32", None, ValueError, "shape must be a sequence of non-negative integers"),
    ("abc", "float32", None, ValueError, "shape must be a sequence of non-negative integers"),
    ((1024,), object, None, TypeError, "is not one prefetchd stores"),
    ((256,), "U4", None, TypeError, "is not one prefetchd stores"),
    # Same bytes, another layout: read back as other values (int32 of float32 bits), no error.
    ((1024,), "int32", None, ValueError, r"the store holds shape \[1024\] of float32, not shape \[1024\] of int32"),
    ((512, 2), "float32", None, ValueError, r"not shape \[512, 2\] of float32"),
    ((2048,), "float16", None, ValueError, r"not shape \[2048\] of float16"),
    # A target of another layout was rebound to this one; a Parameter one killed use() (SIGSEGV).
    ((1024,), "float32", ("param", (1024,), "float16"), ValueError, r"target is shape \[1024\] of float16"),
    ((1024,), "float32", ("param", (2048,), "float16"), ValueError, r"target is shape \[2048\] of float16"),
    ((1024,), "float32", ("tensor", (4, 256), "float32"), ValueError, r"target is shape \[4, 256\] of float32"),
])
def test_register_remote_checks_every_argument_before_registering(make_daemon, make_param, store_dir,
                                                                   ms, shape, dtype, target, error, says):
    """Each was refused with a raw numpy error, or accepted, after the name was registered:
    a retry was refused as a double registration, and a numpy target killed close()."""
    with make_daemon() as first:
        first.register(make_param(np.arange(1024, dtype=np.float32), "w"), tier="remote")
    daemon = make_daemon()
    if target == "numpy":
        target = np.zeros(1024, np.float32)
    elif target is not None:
        kind, target_shape, target_dtype = target
        target = ms.Tensor(np.zeros(target_shape, target_dtype))
        if kind == "param":
            target = ms.Parameter(target, name="w_target")
    with pytest.raises(error, match=says):
        daemon.register_remote("w", shape, dtype, target=target)
    assert daemon.names() == []
    into = ms.Tensor(np.zeros(1024, np.float32))
    daemon.register_remote("w", (1024,), "float32", target=into)
    with daemon.use(["w"]):
        np.testing.assert_array_equal(into.asnumpy(), np.arange(1024, dtype=np.float32))
    daemon.close()
    assert daemon.closed


@pytest.mark.parametrize("key", ["lookahead", "io_threads", "metrics_port"])
def test_a_toml_bool_is_not_an_integer(tmp_path, key):
    path = tmp_path / "c.toml"
    path.write_text(f"[prefetchd]\n{key} = true\n")
    with pytest.raises(ConfigError, match=f"{key}: expected an integer, got True"):
        Config.load(path=str(path), env={})


def test_a_misspelled_setting_in_the_environment_is_warned_about_once(caplog):
    env = {"PREFETCHD_LOOKAHAED": "3", "PREFETCHD_LOG_LEVEL": "INFO", "PREFETCHD_LOOKAHEAD": "1"}
    with caplog.at_level(logging.WARNING, logger="prefetchd.config"):
        assert Config.load(env=env).lookahead == 1
        Config.load(env=env)
    said = [r.getMessage() for r in caplog.records]
    assert said == ["PREFETCHD_LOOKAHAED is not a prefetchd setting and is ignored "
                    "(did you mean PREFETCHD_LOOKAHEAD?)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prefetchd.config"):
        Config.load(env={"PREFETCHD_lookahead": "3", "prefetchd_LOOKAHEAD": "3"})   # (was PREFETCHD_RANK?; none)
    assert sorted(r.getMessage() for r in caplog.records) == [
        f"{name} is not a prefetchd setting and is ignored (did you mean PREFETCHD_LOOKAHEAD?)"
        for name in ("PREFETCHD_lookahead", "prefetchd_LOOKAHEAD")]


def test_a_tensor_managed_by_one_live_daemon_is_refused_by_another(make_daemon, ms, tmp_path):
    """Both accepted it; the second then bound it to its memory, and reading it inside the
    first's use() after the second evicted it was a SIGSEGV. Once the first has closed,
    another daemon may manage it."""
    one = make_daemon(name="one", store_dir=str(tmp_path / "one"))
    two = make_daemon(name="two", store_dir=str(tmp_path / "two"))
    t = ms.Tensor(np.arange(1024, dtype=np.float32))
    one.register(t, "w")
    with pytest.raises(DoubleRegisterError, match="managed by prefetchd daemon 'one'"):
        two.register(t, "w")
    assert two.names() == []
    one.evict(["w"]).result(10)
    with one.use(["w"]):
        np.testing.assert_array_equal(t.asnumpy(), np.arange(1024, dtype=np.float32))
    one.close()
    two.register(t, "w")            # the closed daemon manages it no more
    two.evict(["w"]).result(10)
    with two.use(["w"]):
        np.testing.assert_array_equal(t.asnumpy(), np.arange(1024, dtype=np.float32))


@pytest.mark.parametrize("where", ["callback", "listener"])
@pytest.mark.parametrize("wait", ["unregister", "use", "result", "register", "futures_wait"])
def test_a_wait_on_the_scheduler_thread_is_refused_at_once(make_daemon, ms, where, wait):
    """Future callbacks and listeners run on the scheduler thread. A wait there blocked
    the only thread that could end it: the daemon stuck for good, every later request
    hung, close() gave up with the thread left running."""
    daemon = make_daemon(shutdown_timeout=3.0)
    for i in range(3):
        daemon.register(ms.Tensor(np.full(1024, i, np.float32)), f"w{i}", tier="remote")
    outcome, ran = [], threading.Event()

    def waits(*_):
        if ran.is_set():
            return
        ran.set()
        try:
            if wait == "unregister":
                daemon.unregister(["w2"])
            elif wait == "use":
                with daemon.use(["w1"]):
                    pass
            elif wait == "result":
                daemon.prefetch("w2").result()
            elif wait == "futures_wait":
                concurrent.futures.wait([daemon.prefetch("w2")])
            else:
                daemon.register(ms.Tensor(np.zeros(4, np.float32)), "new")
            outcome.append("returned")
        except SchedulerWaitError as e:
            outcome.append(str(e))

    if where == "listener":
        daemon.add_listener(waits)
    daemon.prefetch("w0").add_done_callback(waits)
    assert ran.wait(10)
    assert wait_until(lambda: outcome, 5), "the wait blocked the scheduler thread"
    assert "would wait forever" in outcome[0], outcome
    daemon.prefetch("w1").result(10)            # the scheduler still runs
    assert sorted(daemon.names()) == ["w0", "w1", "w2"]   # and nothing was half-done
    assert daemon.status()["pinned_bytes"] == 0
    started = time.monotonic()
    daemon.close()
    assert daemon.closed and time.monotonic() - started < 2.0


@pytest.mark.parametrize("body_raises", [False, True])
def test_leaving_use_after_another_thread_closed_the_daemon_keeps_the_bodys_outcome(make_daemon, ms, body_raises):
    """The unpin on leaving `use` was refused with ShutdownError, which replaced the body's own
    exception (or failed a body that had succeeded): the pins of a closed daemon hold nothing."""
    daemon = make_daemon()
    t = ms.Tensor(np.arange(1024, dtype=np.float32))
    daemon.register(t, "w")
    inside, closed, outcome = threading.Event(), threading.Event(), {}

    def user():
        try:
            with daemon.use(["w"]):
                inside.set()
                closed.wait(10)
                outcome["read"] = float(t.asnumpy()[3])      # resident at close: still readable
                if body_raises:
                    raise ValueError("the body's own error")
            outcome["error"] = None
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=user)
    thread.start()
    assert inside.wait(10)
    daemon.close()
    closed.set()
    thread.join(10)
    assert outcome["read"] == 3.0
    if body_raises:
        assert isinstance(outcome["error"], ValueError), repr(outcome["error"])
    else:
        assert outcome["error"] is None, repr(outcome["error"])


@pytest.mark.parametrize("how", ["close_from_a_callback", "dropped"])
def test_a_daemon_that_stops_without_a_full_close_lets_its_tensors_go(ms, tmp_path, how):
    """Only a close() that saw its scheduler stop let another daemon manage its tensors: one
    closed from a future's callback kept them until a second close(), and one dropped without
    close() (its finalizer stops it) kept them for the life of the process."""
    t = ms.Tensor(np.arange(1024, dtype=np.float32))
    first = Daemon(device_budget="16MiB", store_dir=str(tmp_path / "one"), name="one").start()
    first.register(t, "w")
    thread = first._thread
    if how == "dropped":
        del first
        gc.collect()
    else:
        first.evict(["w"]).result(10)           # so the prefetch's callback runs on the scheduler
        first.prefetch("w").add_done_callback(lambda f: first.close())
    thread.join(15)
    assert not thread.is_alive()
    with Daemon(device_budget="16MiB", store_dir=str(tmp_path / "two"), name="two") as second:
        second.register(t, "w")
        second.evict(["w"]).result(10)
        with second.use(["w"]):
            np.testing.assert_array_equal(t.asnumpy(), np.arange(1024, dtype=np.float32))
    if how != "dropped":
        first.close()


def test_a_bounded_wait_or_another_daemons_wait_on_a_scheduler_thread_is_not_refused(make_daemon, ms, tmp_path):
    """Only what would wait for the thread it runs on is refused: a bounded wait times out as
    before, and another daemon's requests are settled by that daemon's own scheduler."""
    one = make_daemon(name="one", store_dir=str(tmp_path / "one"))
    two = make_daemon(name="two", store_dir=str(tmp_path / "two"))
    one.register(ms.Tensor(np.zeros(1024, np.float32)), "a", tier="remote")
    one.register(ms.Tensor(np.zeros(1024, np.float32)), "b", tier="remote")
    two.register(ms.Tensor(np.ones(1024, np.float32)), "c", tier="remote")
    outcome, ran = {}, threading.Event()

    def in_callback(_):
        try:
            try:
                one.prefetch("b").result(timeout=0.001)
                outcome["bounded"] = "settled"
            except concurrent.futures.TimeoutError:
                outcome["bounded"] = "timed out"
            two.prefetch("c").result(10)
            outcome["other"] = two.register(ms.Tensor(np.zeros(8, np.float32)), "d").name
        except Exception as e:       # noqa: BLE001 - reported below
            outcome["error"] = repr(e)
        ran.set()

    one.prefetch("a").add_done_callback(in_callback)
    assert ran.wait(20)
    assert "error" not in outcome, outcome
    assert outcome["bounded"] in ("timed out", "settled") and outcome["other"] == "d"


def test_backend_given_by_name_is_the_config_key_and_a_non_backend_is_refused(store_dir):
    # Daemon(backend="cpu") was taken as a backend object: two AttributeError tracebacks,
    # the second from the close at exit.
    with Daemon(backend="cpu", device_budget="16MiB", store_dir=store_dir) as daemon:
        assert daemon.status()["backend"] == "cpu"
    with pytest.raises(ConfigError, match="backend: must be one of cpu"):
        Daemon(backend="gpu", store_dir=store_dir)
    with pytest.raises(TypeError, match=r"Daemon\(backend=...\): a backend object \(or a name such as 'cpu'\), "
                                        r"not int"):
        Daemon(backend=3, store_dir=store_dir)
    from prefetchd.backend.cpu import CpuBackend
    with pytest.raises(TypeError, match="not the class CpuBackend"):        # (it has a notify method)
        Daemon(backend=CpuBackend, store_dir=store_dir)
