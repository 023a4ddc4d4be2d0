"""flush() settles only when every write-back it covers has settled, and reports every one
that failed. It resolved at the first failure, naming one tensor, while the others were
still being written: a caller that then closed or retried raced those write-backs and
never learned which other tensors stayed dirty."""
import time

import numpy as np
import pytest

from prefetchd.errors import FlushError, StorageError

MiB = 1 << 20
DELAY = 1.0               # seconds the slow write-back takes (injected)


@pytest.fixture
def dirty(make_daemon, make_param, native_faults):
    """A daemon with three dirty device tensors: two whose write fails, one slow to write."""
    daemon = make_daemon(device_budget="16MiB")
    handles = {name: daemon.register(make_param(np.full(MiB // 4, i, np.float32), name), tier="device")
               for i, name in enumerate(["fail.a", "fail.b", "slow.c"])}
    native_faults.inject_fault("write", "error", nth=1, count=2, err=5, key_contains="fail.")
    native_faults.inject_fault("write", "delay", nth=1, delay_ms=int(DELAY * 1000), key_contains="slow.")
    return daemon, handles


def test_flush_of_everything_waits_for_every_writeback_and_names_every_failure(dirty):
    daemon, handles = dirty
    started = time.monotonic()
    future = daemon.flush()
    with pytest.raises(FlushError) as err:
        future.result(30)
    settled = time.monotonic() - started
    assert settled >= DELAY * 0.9, f"settled after {settled:.2f}s, before the slow write-back ended"
    assert set(err.value.failures) == {"fail.a", "fail.b"}
    assert all(isinstance(e, StorageError) and "EIO" in str(e) for e in err.value.failures.values())
    assert "2 write-backs failed" in str(err.value) and "'fail.a'" in str(err.value) \
        and "'fail.b'" in str(err.value)
    status = {t["name"]: t for t in daemon.tensors()}
    assert status["slow.c"]["dirty"] is False                  # written back before flush settled
    assert status["fail.a"]["dirty"] and status["fail.b"]["dirty"]  # kept, dirty, in place


def test_flush_of_named_tensors_reports_only_theirs(dirty):
    daemon, handles = dirty
    with pytest.raises(FlushError) as err:
        daemon.flush([handles["fail.b"], handles["slow.c"]]).result(30)
    assert list(err.value.failures) == ["fail.b"]
    assert str(err.value) == str(err.value.failures["fail.b"])   # one failure: its own message
    assert {t["name"]: t["dirty"] for t in daemon.tensors()}["slow.c"] is False


def test_a_flush_whose_writebacks_all_succeed_resolves(make_daemon, make_param):
    daemon = make_daemon(device_budget="16MiB")
    for i in range(3):
        daemon.register(make_param(np.full(1024, i, np.float32), f"ok.{i}"), tier="device")
    assert daemon.flush().result(30) is None
    assert not any(t["dirty"] for t in daemon.tensors())
