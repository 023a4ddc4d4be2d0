import numpy as np
import pytest

from prefetchd import ops


def tensor(ms, array):
    return ms.Tensor(np.ascontiguousarray(array))


@pytest.fixture(autouse=True)
def ops_store(tmp_path, monkeypatch):
    """A fresh operator runtime with its store under tmp_path."""
    monkeypatch.setenv("PREFETCHD_STORE_DIR", str(tmp_path))
    monkeypatch.setenv("PREFETCHD_DEVICE_BUDGET", "768MiB")
    monkeypatch.setattr(ops, "_runtime", None)
    yield
    ops._runtime = None
