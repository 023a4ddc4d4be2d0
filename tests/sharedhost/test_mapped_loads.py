"""Loads from the shared host tier on the cpu backend map the shared pages (no copy):
the tensor's home maps the owner's segment while resident; where the owner's budget
holds the whole store, a dropped tensor's mapping stays parked under its home
(PROT_NONE, lease held) and its next load unparks it; otherwise the worker holds a
lease exactly while its device tier maps a block. `shared_host_map = false` copies."""
import os

import numpy as np
import pytest

from prefetchd import _native
from prefetchd.daemon import Daemon
from prefetchd.sharedhost.owner import SharedHostOwner
from helpers import wait_until
from procs import link_store, stage

N = 1 << 18                     # floats: 1 MiB tensors
TENSORS = {f"t{i}": [i, N] for i in range(4)}
SEGMENT = "memfd:prefetchd-host:"

pytestmark = pytest.mark.skipif(not _native.segment_maps_supported(),
                                reason="the kernel cannot move private file mappings (Linux < 5.13)")


def values(name):
    return np.random.default_rng(TENSORS[name][0]).standard_normal(N).astype(np.float32)


def mapping_of(address):
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= address < hi:
            return line.strip()
    return ""


def _start_owner(tmp_path, budget):
    src = stage(str(tmp_path), TENSORS)
    o = SharedHostOwner(str(tmp_path / "h.sock"), link_store(src, str(tmp_path / "own")), budget).start()
    o.src = src
    return o


@pytest.fixture
def owner(tmp_path):
    o = _start_owner(tmp_path, 64 << 20)          # covering: the four 1 MiB blocks fit at once
    yield o
    o.close()


@pytest.fixture
def small_owner(tmp_path):
    o = _start_owner(tmp_path, (3 << 20) + (1 << 19))   # three of the four blocks fit
    yield o
    o.close()


def _daemon(owner, tmp_path, **kw):
    kw = {"device_budget": 3 << 20, "host_budget": 0, "lookahead": 0, **kw}
    return Daemon(store_dir=link_store(owner.src, str(tmp_path / "w")), shared_host=owner.path, **kw).start()


def _owner_leases(owner):
    return sum(w["leases"] for w in owner.status()["workers"])


def test_a_resident_weight_is_the_shared_pages_and_a_dropped_one_stays_parked_under_its_home(
        owner, tmp_path):
    from prefetchd.sharedhost.owner import COUNTERS
    # Every counter from the start, at 0 (a monitoring script's counters["hits"] was a KeyError).
    assert {k: owner.status()["counters"][k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0)
    d = _daemon(owner, tmp_path)
    try:
        assert d.status()["shared_host"]["covering"]
        handles = [d.register_remote(name, (N,), np.float32) for name in TENSORS]
        for _ in range(3):                       # the budget holds three of four: each round reloads
            for name, h in zip(TENSORS, handles):
                with d.use([h]) as recs:
                    home = recs[0].home
                    assert np.array_equal(np.frombuffer(home, np.float32, N), values(name))
                    assert SEGMENT + name in mapping_of(home.address), "the home does not map the segment"
        shared = d.status()["shared_host"]
        assert shared["mapped"] == shared["hits"] == 4 and shared["fallbacks"] == 0   # one map each
        moves = d.status()["page_moves"]
        assert moves["copied_bytes"] == 0 and moves["unparked_bytes"] == 8 * 4 * N   # the other 8 loads
        assert owner.status()["counters"]["fills"] == 4          # one store read per tensor
        assert shared["mapped_leases"] == 4 and wait_until(lambda: _owner_leases(owner) == 4, 5)
        d.evict(handles).result(30)
        shared = d.status()["shared_host"]
        assert shared["parked_leases"] == shared["mapped_leases"] == 4      # parked, leases kept
        assert d.status()["host"]["parked_bytes"] == 4 * 4 * N and d.status()["device"]["used"] == 0
        rec = d.record(handles[0])
        line = mapping_of(rec.home.address)
        assert SEGMENT + "t0" in line and line.split()[1] == "---p", line   # unreadable, still mapped
        with d.use(handles[:1]) as recs:
            assert np.array_equal(np.frombuffer(recs[0].home, np.float32, N), values("t0"))
        assert d.status()["shared_host"]["hits"] == 4            # no request to the owner
    finally:
        d.close(10)
    assert wait_until(lambda: owner.status()["leases"] == 0, 5)   # closing released every lease


def test_without_a_covering_budget_the_lease_lasts_only_while_mapped(small_owner, tmp_path):
    owner = small_owner
    d = _daemon(owner, tmp_path)
    try:
        assert not d.status()["shared_host"]["covering"]
        handles = [d.register_remote(name, (N,), np.float32) for name in TENSORS]
        for _ in range(3):
            for name, h in zip(TENSORS, handles):
                with d.use([h]) as recs:
                    home = recs[0].home
                    assert np.array_equal(np.frombuffer(home, np.float32, N), values(name))
                # a lease per device block mapping a segment: at most the 3 MiB budget's three
                # (a release has no reply: the owner may count it a moment later)
                held = d.status()["shared_host"]["mapped_leases"]
                assert 1 <= held <= 3 and wait_until(lambda: _owner_leases(owner) == held, 5)
        shared = d.status()["shared_host"]
        assert shared["parked_leases"] == 0 and d.status()["host"]["parked_bytes"] == 0
        assert shared["mapped"] == shared["hits"] and shared["hits"] + shared["fallbacks"] == 12
        d.evict(handles).result(30)
        assert d.status()["shared_host"]["mapped_leases"] == 0
        assert wait_until(lambda: _owner_leases(owner) == 0, 5)
    finally:
        d.close(10)


def test_shared_host_map_false_copies_and_holds_no_lease_when_idle(owner, tmp_path):
    d = _daemon(owner, tmp_path, shared_host_map=False)
    try:
        h = d.register_remote("t1", (N,), np.float32)
        with d.use([h]) as recs:
            assert np.array_equal(np.frombuffer(recs[0].home, np.float32, N), values("t1"))
            assert SEGMENT not in mapping_of(recs[0].home.address)
        shared = d.status()["shared_host"]
        assert shared["hits"] == 1 and shared["mapped"] == 0 and shared["mapped_leases"] == 0
        assert _owner_leases(owner) == 0
    finally:
        d.close(10)


def test_loads_queued_together_go_to_the_owner_in_one_request(owner, tmp_path):
    """The load thread sends what is queued by the time it runs as one acquire (and the
    leases freed meanwhile as one release): held back here by the client's lock."""
    d = _daemon(owner, tmp_path, device_budget=16 << 20)
    try:
        names = list(TENSORS)
        handles = [d.register_remote(name, (N,), np.float32) for name in names]
        client = d.backend.shared.client
        before = owner.status()["counters"].get("acquire_requests", 0)
        with client._lock:                          # the load thread waits at its first request
            futures = [d.prefetch([h]) for h in handles]
            assert wait_until(lambda: d.status()["in_flight"] == 4, 10)   # all four started
        for f in futures:
            f.result(30)
        counters = owner.status()["counters"]
        assert counters.get("hits", 0) + counters["fills"] == 4
        assert counters["acquire_requests"] - before <= 2     # the first alone at most, the rest batched
        for name, h in zip(names, handles):
            with d.use([h]) as recs:
                assert np.array_equal(np.frombuffer(recs[0].home, np.float32, N), values(name))
        d.evict(handles).result(30)                 # parked (a covering owner): leases kept
        assert d.status()["shared_host"]["parked_leases"] == 4 and _owner_leases(owner) == 4
    finally:
        d.close(10)
    assert wait_until(lambda: _owner_leases(owner) == 0, 5)


def test_unregister_ends_the_leases_of_parked_mappings_and_keeps_the_staged_files(owner, tmp_path):
    d = _daemon(owner, tmp_path)
    try:
        handles = [d.register_remote(name, (N,), np.float32) for name in TENSORS]
        for h in handles:
            with d.use([h]):
                pass
        d.evict(handles).result(30)
        assert d.status()["shared_host"]["parked_leases"] == 4
        store = sorted(os.listdir(tmp_path / "w"))
        d.unregister(handles)
        shared = d.status()["shared_host"]
        assert d.names() == [] and shared["parked_leases"] == shared["mapped_leases"] == 0
        assert d.status()["host"]["parked_bytes"] == 0
        assert wait_until(lambda: _owner_leases(owner) == 0, 5)
        assert sorted(os.listdir(tmp_path / "w")) == store          # register_remote: the user's files
        h = d.register_remote("t2", (N,), np.float32)                # and loadable again
        with d.use([h]) as recs:
            assert np.array_equal(np.frombuffer(recs[0].home, np.float32, N), values("t2"))
    finally:
        d.close(10)
