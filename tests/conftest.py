"""Shared fixtures: MindSpore on CPU, real stores on disk, daemons, leak checks."""
import gc
import os
import threading

import numpy as np
import pytest

os.environ.setdefault("GLOG_v", "3")          # MindSpore: errors only
os.environ.setdefault("MS_SUBMODULE_LOG_v", "{ME:3}")


@pytest.fixture(scope="session", autouse=True)
def mindspore_cpu():
    import mindspore as ms
    ms.set_device("CPU")
    return ms


@pytest.fixture
def ms(mindspore_cpu):
    return mindspore_cpu


@pytest.fixture
def native_faults():
    """prefetchd._native, with no injected fault (inject_fault) before or after the test."""
    from prefetchd import _native
    _native.clear_faults()
    yield _native
    _native.clear_faults()


@pytest.fixture
def store_dir(tmp_path):
    """A store directory on the real disk (tmp_path is on ext4 here: O_DIRECT works)."""
    d = tmp_path / "store"
    d.mkdir()
    return str(d)


@pytest.fixture
def make_daemon(store_dir):
    """Factory of started daemons, all closed at teardown."""
    from prefetchd import Daemon
    made = []

    def make(**overrides):
        overrides.setdefault("store_dir", store_dir)
        overrides.setdefault("device_budget", "64MiB")
        overrides.setdefault("shutdown_timeout", 10.0)
        d = Daemon(**overrides).start()
        made.append(d)
        return d
    yield make
    for d in made:
        d.close()


@pytest.fixture
def daemon(make_daemon):
    return make_daemon()


def param(ms, values, name):
    return ms.Parameter(ms.Tensor(np.ascontiguousarray(values)), name=name)


@pytest.fixture
def make_param(ms):
    return lambda values, name: param(ms, values, name)


def _threads():
    return {t.ident for t in threading.enumerate()}


@pytest.fixture
def no_leaks():
    """Fails the test if it leaves threads or file descriptors behind."""
    gc.collect()
    threads_before = _threads()
    fds_before = set(os.listdir("/proc/self/fd"))
    yield
    gc.collect()
    leaked_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before and t.is_alive()]
    fds_after = set(os.listdir("/proc/self/fd"))
    leaked_fds = {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in fds_after - fds_before
                  if os.path.exists(f"/proc/self/fd/{fd}")}
    assert not leaked_threads, f"threads left running: {leaked_threads}"
    assert not leaked_fds, f"file descriptors left open: {leaked_fds}"
