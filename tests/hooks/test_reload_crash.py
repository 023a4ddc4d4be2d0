"""A prefetchd.load_param_into_net that its process did not live to finish, seen by the next
process that offloads the model from the same store (real processes, kill -9, a staged
store on disk). The store got each weight's new value only when it was written back, so
a process killed during a load left old weights beside new ones, and the next process's
model ran on that mix, saying nothing (an outside probe: 6 of 6 reopened stores)."""
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import ENV

CHILD = r"""
import contextlib, os, signal, sys
import numpy as np
import mindspore as ms
import prefetchd
store, new_ckpt, phase = sys.argv[1:4]


def model(seed):
    ms.set_seed(seed)
    return ms.nn.SequentialCell([ms.nn.Dense(64, 64) for _ in range(6)])


x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32))
net = model(0)
daemon = prefetchd.Daemon(device_budget=3 * 20480, store_dir=store).start()
prefetchd.offload(net, daemon, lookahead=1, checkpoint=True)
if phase == "killed-mid-load":
    use, calls = daemon.use, []

    @contextlib.contextmanager
    def dies_at_the_fourth(tensors, **kwargs):
        calls.append(1)
        if len(calls) == 4:                       # three weights written, the process killed
            os.kill(os.getpid(), signal.SIGKILL)
        with use(tensors, **kwargs) as recs:
            yield recs
    daemon.use = dies_at_the_fourth
    prefetchd.load_param_into_net(net, ms.load_checkpoint(new_ckpt))
    print("the load returned", flush=True)
elif phase == "load-then-killed":
    try:
        net(x)
        print("ran", flush=True)
    except prefetchd.PrefetchdError as e:
        print("refused:", e, flush=True)
    prefetchd.load_param_into_net(net, ms.load_checkpoint(new_ckpt))
    os.kill(os.getpid(), signal.SIGKILL)          # as it returns, nothing closed: it must be on disk
else:                                             # "run"
    np.save(sys.argv[4], net(x).asnumpy())
    print("ran", flush=True)
    daemon.close()
"""


def _child(phase, store, new_ckpt, out=""):
    return subprocess.run([sys.executable, "-c", CHILD, str(store), str(new_ckpt), phase, str(out)],
                          capture_output=True, text=True, timeout=180, env=ENV)


@pytest.fixture
def staged(ms, tmp_path):
    """(store staged from model(0), a checkpoint of model(7), model(7)'s output on x)."""
    from prefetchd.staging import stage_checkpoint

    def model(seed):
        ms.set_seed(seed)
        return ms.nn.SequentialCell([ms.nn.Dense(64, 64) for _ in range(6)])
    x = ms.Tensor(np.random.default_rng(0).standard_normal((2, 64)).astype(np.float32))
    ms.save_checkpoint(model(0), str(tmp_path / "old.ckpt"))
    new = model(7)
    ms.save_checkpoint(new, str(tmp_path / "new.ckpt"))
    store = tmp_path / "store"
    stage_checkpoint(str(tmp_path / "old.ckpt"), str(store))
    return store, tmp_path / "new.ckpt", new(x).asnumpy()


def _killed_mid_load(store, new_ckpt):
    killed = _child("killed-mid-load", store, new_ckpt)
    assert killed.returncode == -signal.SIGKILL and "the load returned" not in killed.stdout, killed.stderr[-3000:]


def test_a_load_killed_part_way_leaves_the_next_process_refusing_until_a_load_completes(staged, tmp_path):
    store, new_ckpt, want = staged
    _killed_mid_load(store, new_ckpt)
    reloaded = _child("load-then-killed", store, new_ckpt)
    assert reloaded.returncode == -signal.SIGKILL, reloaded.stderr[-3000:]
    assert "refused: prefetchd: a load_param_into_net into this SequentialCell did not finish before its " \
           "process ended" in reloaded.stdout, reloaded.stdout + reloaded.stderr[-3000:]
    # That load returned and its process was killed at once, nothing closed: the store holds it whole.
    ran = _child("run", store, new_ckpt, tmp_path / "after.npy")
    assert ran.returncode == 0 and "ran" in ran.stdout, ran.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "after.npy"), want)
    assert not [n for n in os.listdir(store) if n.startswith(".pfd-load-")]


def test_a_stage_of_the_whole_checkpoint_clears_what_a_killed_load_left(staged, tmp_path):
    from prefetchd.staging import stage_checkpoint
    store, new_ckpt, want = staged
    _killed_mid_load(store, new_ckpt)
    assert [n for n in os.listdir(store) if n.startswith(".pfd-load-")]
    stage_checkpoint(str(new_ckpt), str(store))
    ran = _child("run", store, new_ckpt, tmp_path / "after.npy")
    assert ran.returncode == 0 and "ran" in ran.stdout, ran.stderr[-3000:]
    np.testing.assert_array_equal(np.load(tmp_path / "after.npy"), want)
