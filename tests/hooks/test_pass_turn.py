"""One thread's pass at a time (prefetchd/hooks/pass_turn.py), with real threads: a turn
held by a pass inside the model, or by a block between passes, is waited for however long
it lasts; a pass whose thread left the model without giving the turn back (Ctrl-C) is
taken over."""
import threading
import time

import pytest

from prefetchd.hooks.pass_turn import POLL, PassTurn


@pytest.fixture
def model(ms):
    class Slow(ms.nn.Cell):
        """A model whose forward waits until told to go on."""

        def __init__(self):
            super().__init__()
            self.go = threading.Event()
            self.entered = threading.Event()

        def construct(self, x):
            self.entered.set()
            self.go.wait(30)
            return x
    return Slow()


def taken_within(turn, seconds):
    """Start a thread taking the turn; True if it got it within `seconds`."""
    got = threading.Event()

    def take():
        turn.take()
        got.set()
        turn.give()
    threading.Thread(target=take, daemon=True).start()
    return got.wait(seconds)


def test_a_pass_inside_the_model_is_waited_for(ms, model):
    turn = PassTurn(model, on_abandoned=lambda: None)
    model.register_forward_pre_hook(lambda cell, inputs: turn.take())
    model.register_forward_hook(lambda cell, inputs, output: turn.give())
    runner = threading.Thread(target=lambda: model(ms.Tensor([1.0])), daemon=True)
    runner.start()
    assert model.entered.wait(30)
    assert not taken_within(turn, 6 * POLL)           # the holder is inside: no takeover
    model.go.set()
    runner.join(30)
    assert taken_within(turn, 5)


def test_a_block_between_passes_is_waited_for_however_long(ms, model):
    """A held() block is not a pass: its thread is rightly outside the model. A pass waiting
    longer than POLL took it over as abandoned, and forwards ran beside a load_param_into_net
    on another thread, computing with half-loaded weights."""
    turn = PassTurn(model, on_abandoned=lambda: None)
    inside, leave = threading.Event(), threading.Event()

    def block():
        with turn.held():
            inside.set()
            leave.wait(30)
    threading.Thread(target=block, daemon=True).start()
    assert inside.wait(30)
    assert not taken_within(turn, 6 * POLL)
    leave.set()
    assert taken_within(turn, 5)


def test_a_pass_cut_short_is_taken_over(ms, model):
    abandoned = []
    turn = PassTurn(model, on_abandoned=lambda: abandoned.append(True))
    took, done = threading.Event(), threading.Event()

    def cut_short():                  # takes the turn, leaves the model without giving it back
        turn.take()
        took.set()
        done.wait(30)                 # alive (a dead thread's ident may be reused)
    threading.Thread(target=cut_short, daemon=True).start()
    assert took.wait(30)
    started = time.monotonic()
    assert taken_within(turn, 5)
    assert abandoned == [True] and time.monotonic() - started < 2
    done.set()


@pytest.mark.parametrize("call", ["forward", "close"])
def test_a_listener_waiting_for_another_threads_forward_is_refused_not_deadlocked(ms, tmp_path, call):
    """A listener (on the scheduler thread) that runs the model, or closes its handle, while
    another thread's forward holds the turn waited for that forward, which waited for the
    scheduler to settle its loads: both stuck for good."""
    import numpy as np
    import prefetchd
    from prefetchd.errors import SchedulerWaitError
    ms.set_seed(1)
    model = ms.nn.SequentialCell([ms.nn.SequentialCell([ms.nn.Dense(64, 64), ms.nn.ReLU()]) for _ in range(6)])
    model.set_train(False)
    x = ms.Tensor(np.ones((2, 64), np.float32))
    expected = model(x).asnumpy()
    budget = int(sum(p.nbytes for p in model.get_parameters()) * 0.6)
    with prefetchd.Daemon(device_budget=budget, store_dir=str(tmp_path / "s"), shutdown_timeout=3.0) as daemon:
        handle = prefetchd.offload(model, daemon, lookahead=1)
        model(x)
        outcome, ran = [], threading.Event()

        def listener(event):
            # Block 2's load: it is not resident when the pass starts, and blocks after it still
            # load on this thread, so the forward holds the turn until the listener returns.
            # (On the first load seen, it could be a prefetch the finished forward left for
            # the next pass: the turn was free, and the refusal was the scheduler thread's.)
            if ran.is_set() or event.get("event") != "loaded" or not event["name"].startswith("2."):
                return
            ran.set()
            try:
                model(x) if call == "forward" else handle.close()
                outcome.append("returned")
            except SchedulerWaitError as e:
                outcome.append(str(e))

        daemon.add_listener(listener)
        result = {}
        forward = threading.Thread(target=lambda: result.setdefault("out", model(x).asnumpy()), daemon=True)
        forward.start()
        forward.join(30)
        assert not forward.is_alive(), "the forward and the listener deadlocked"
        daemon.remove_listener(listener)
        assert ran.is_set() and outcome and "another thread's forward" in outcome[0], outcome
        np.testing.assert_array_equal(result["out"], expected)
        np.testing.assert_array_equal(model(x).asnumpy(), expected)
        handle.close()


def test_a_pass_opened_by_an_inner_cell_called_alone_is_waited_for(ms, tmp_path):
    """`model.encoder(x)` called alone opens a pass of the model (hooks/outer_calls.py). A
    forward of the model on another thread waits for it, however long it lasts, and is not
    taken over as abandoned: the holder is inside the encoder's call, not the model's."""
    import numpy as np
    import prefetchd
    nn = ms.nn

    class Waiting(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(64, 64)
            self.go, self.entered, self.wait = threading.Event(), threading.Event(), False

        def construct(self, x):
            if self.wait:
                self.entered.set()
                self.go.wait(30)
            return self.fc(x)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.encoder = nn.SequentialCell([Waiting() for _ in range(3)])
            self.head = nn.Dense(64, 64)

        def construct(self, x):
            return self.head(self.encoder(x))

    ms.set_seed(0)
    net = Net()
    net.set_train(False)
    x = ms.Tensor(np.ones((2, 64), np.float32))
    want_encoder, want = net.encoder(x).asnumpy(), net(x).asnumpy()
    budget = int(sum(p.nbytes for p in net.get_parameters()) * 0.7)
    with prefetchd.Daemon(device_budget=budget, store_dir=str(tmp_path / "s")) as daemon:
        handle = prefetchd.offload(net, daemon, lookahead=1, units=[f"encoder.{i}" for i in range(3)] + ["head"])
        net(x)
        slow = net.encoder[1]
        slow.wait = True
        got = {}
        alone = threading.Thread(target=lambda: got.setdefault("encoder", net.encoder(x).asnumpy()), daemon=True)
        alone.start()
        assert slow.entered.wait(30)
        slow.wait = False
        forward = threading.Thread(target=lambda: got.setdefault("model", net(x).asnumpy()), daemon=True)
        forward.start()
        forward.join(20 * POLL)
        assert forward.is_alive() and "model" not in got, "the forward ran beside the encoder's pass"
        slow.go.set()
        alone.join(30)
        forward.join(30)
        np.testing.assert_array_equal(got["encoder"], want_encoder)
        np.testing.assert_array_equal(got["model"], want)
        handle.close()
