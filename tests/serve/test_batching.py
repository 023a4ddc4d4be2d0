"""The front's Batcher by itself (no sockets, no workers): which queued requests each
batch takes. Round-robin over the clients (connections) with requests queued, the one
served least recently first; each client's own in order; only compatible ones joined."""
import functools

from prefetchd.serve.batching import Batcher, Job


def job(client, n, key="k", rows=1, received=0.0, model="m0"):
    return Job(envelope=[client, b""], rid=n.to_bytes(8, "big"), model=model, kind="infer", inputs=[],
               frames=[], rows=rows, key=key, hint=False, deadline=1e9, received=received)


def taken(batcher, model="m0"):
    return [(j.envelope[0], int.from_bytes(j.rid, "big")) for j in batcher.take(model)]


def test_a_client_that_floods_delays_anothers_request_by_one_batch_not_by_its_whole_queue():
    """An outside probe: one client queued 1500 requests and a second client's request,
    first come first served, waited out its 5 s timeout behind them."""
    b = Batcher(max_batch_size=4)
    for n in range(1000):
        b.add(job(b"flood", n))
    b.add(job(b"other", 0))
    first = taken(b)
    assert (b"other", 0) in first and len(first) == 4
    assert [n for c, n in first if c == b"flood"] == [0, 1, 2]        # its own still in order


def test_a_flood_for_one_model_delays_anothers_request_for_another_by_one_batch():
    """An outside probe: one client's 400 requests for m0, then another client's one for m1,
    which waited 10 s (behind 1200, its 30 s TIMEOUT): models went by their oldest job's age,
    and the flood's was always the oldest. Across models the clients' round-robin holds too."""
    b = Batcher(max_batch_size=4)
    for n in range(400):
        b.add(job(b"flood", n, received=float(n) / 1000))
    assert [c for c, _ in taken(b, "m0")] == [b"flood"] * 4          # it is being served
    b.add(job(b"other", 0, model="m1", received=1.0))
    assert b.ready_models(now=2.0) == ["m1", "m0"]
    assert taken(b, "m1") == [(b"other", 0)]
    assert b.ready_models(now=2.0) == ["m0"]
    # Two clients each on their own model alternate, whoever queued first.
    for n in range(3):
        b.add(job(b"third", n, model="m2", key=None, received=3.0))     # (one a batch)
    order = []
    for _ in range(4):
        model = b.ready_models(now=4.0)[0]
        order.append(model)
        b.take(model)
    assert order == ["m2", "m0", "m2", "m0"]


def test_a_client_that_filled_the_queue_does_not_keep_the_others_out():
    """An outside probe: one client's burst of 1500 filled the front's queue (1024) and
    another client's single request was BUSY until it drained. A client with nothing queued
    has a reserve beyond the cap (max_queue // 8); the flooding one stays refused."""
    b = Batcher()
    for n in range(1024):
        assert not b.full_for(b"flood", 1024)
        b.add(job(b"flood", n))
    assert b.full_for(b"flood", 1024)
    for client in range(128):                       # the reserve: one request each
        assert not b.full_for(b"c%d" % client, 1024)
        b.add(job(b"c%d" % client, 0))
        assert b.full_for(b"c%d" % client, 1024)    # ...then it has one queued
    assert b.full_for(b"late", 1024) and len(b) == 1024 + 128


def test_batches_alternate_between_busy_clients_least_recently_served_first():
    b = Batcher(max_batch_size=1)
    for n in range(3):
        b.add(job(b"a", n))
    for n in range(3):
        b.add(job(b"b", n))
    assert [taken(b)[0] for _ in range(6)] == [(b"a", 0), (b"b", 0), (b"a", 1), (b"b", 1), (b"a", 2), (b"b", 2)]
    b.add(job(b"a", 3))
    b.add(job(b"c", 0))                   # a newcomer goes before one served a moment ago
    b.add(job(b"b", 3))
    assert [taken(b)[0] for _ in range(3)] == [(b"c", 0), (b"a", 3), (b"b", 3)]


def test_only_requests_with_the_head_key_are_joined_and_the_rest_wait_their_turn():
    b = Batcher(max_batch_size=8)
    b.add(job(b"a", 0, key="x"))
    b.add(job(b"b", 0, key="y"))
    b.add(job(b"a", 1, key="y"))
    b.add(job(b"c", 0, key="x", rows=8))   # would overflow the batch: waits
    b.add(job(b"c", 1, key=None))          # never joined
    assert taken(b) == [(b"a", 0)]
    assert taken(b) == [(b"b", 0), (b"a", 1)]
    assert taken(b) == [(b"c", 0)]
    assert taken(b) == [(b"c", 1)]
    assert len(b) == 0


def test_a_batch_put_back_goes_first_in_its_order():
    b = Batcher(max_batch_size=2)
    for n in range(4):
        b.add(job(b"a", n))
    jobs = b.take("m0")
    for j in reversed(jobs):                # the front, when a batch could not be sent
        b.add(j, first=True)
    assert taken(b) == [(b"a", 0), (b"a", 1)]


def test_the_clients_it_remembers_are_bounded_by_those_with_requests_queued():
    b = Batcher(max_batch_size=1)
    for n in range(5000):
        b.add(job(n.to_bytes(4, "big"), n))
        b.take("m0")
    assert len(b._served) <= 64 + 1


def test_a_workers_join_verdict_bounds_the_requests_one_batch_carries_to_it():
    """A worker runs a batch's requests one after another until it has checked that the
    model's joined outputs split per request, and for good once that check failed: so a
    batch carries two requests to it while it checks (the fewest a check compares), one
    after a failed check, and up to max_batch_size rows once it joins them."""
    from prefetchd.serve.pool import WorkerSlot
    slot = WorkerSlot(0, "ipc://unused")
    sizes = []
    for verdict in ("unknown", None, False, True):
        if verdict != "unknown":
            slot.joined[("m0", "infer")] = verdict
        b = Batcher(max_batch_size=8)
        for n in range(8):
            b.add(job(b"c%d" % n, n))
        sizes.append(len(b.take("m0", functools.partial(slot.parts_for, "m0"))))
    assert sizes == [2, 2, 1, 8]
    assert slot.parts_for("m0", "generate") == 2 and slot.parts_for("m1", "infer") == 2
