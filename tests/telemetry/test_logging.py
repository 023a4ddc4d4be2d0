"""What prefetchd says at INFO: the resolved config and where each value came from,
the I/O engine and why, the unit plan, one line per refusal; DEBUG per transfer."""
import logging

import numpy as np
import pytest

import prefetchd
from prefetchd.errors import PinnedError
from prefetchd.demo.model import build_model, estimate_bytes


def messages(caplog):
    return [r.getMessage() for r in caplog.records]


def test_start_logs_the_config_sources_and_the_io_engine_with_its_reason(store_dir, caplog, monkeypatch):
    monkeypatch.setenv("PREFETCHD_LOOKAHEAD", "3")
    with caplog.at_level(logging.INFO, logger="prefetchd"):
        with prefetchd.Daemon(store_dir=store_dir, device_budget="32MiB"):
            pass
    text = "\n".join(messages(caplog))
    assert "lookahead from env PREFETCHD_LOOKAHEAD" in text and "device_budget from argument" in text
    assert "I/O engine" in text and "O_DIRECT" in text


def test_offload_logs_the_plan_and_refusals_are_one_line_each(make_daemon, make_param, caplog):
    daemon = make_daemon(device_budget=max(int(estimate_bytes(64, 4) * 0.5), 1 << 20))
    with caplog.at_level(logging.INFO, logger="prefetchd"):
        prefetchd.offload(build_model(64, 4, seed=1), daemon, lookahead=1)
        h = daemon.register(make_param(np.ones(1024, np.float32), "w"), tier="remote")
        with daemon.use(h):
            with pytest.raises(PinnedError):
                daemon.evict(h).result(10)
    text = messages(caplog)
    assert any("units + root" in m for m in text), text
    refusals = [m for m in text if "refused" in m]
    assert len(refusals) == 1 and "'w'" in refusals[0] and "pinned" in refusals[0]


def test_debug_logs_each_transfer(make_daemon, make_param, caplog):
    daemon = make_daemon()
    h = daemon.register(make_param(np.ones(1024, np.float32), "w"), tier="remote")
    with caplog.at_level(logging.DEBUG, logger="prefetchd"):
        daemon.prefetch(h).result(10)
    assert any("of 'w' (4096 B) done" in m for m in messages(caplog)), messages(caplog)
