"""The trace cursor (prefetchd/hooks/trace_cursor.py): pure bookkeeping, no threads, no I/O."""
from prefetchd.hooks.trace_cursor import ROOT, TraceCursor


def recorded(*indices):
    cursor = TraceCursor()
    cursor.record(ROOT)
    for index in indices:
        cursor.record(index)
    return cursor


def test_the_recorded_order_is_followed_without_a_resync():
    cursor = recorded(0, 1, 2)
    cursor.start_pass()
    assert [cursor.enter(i) for i in (0, 1, 2)] == [True, True, True]
    assert cursor.position == 3 and cursor.resyncs == 0


def test_a_skipped_unit_resyncs_to_the_nearest_occurrence_ahead_and_is_counted():
    cursor = recorded(0, 1, 0, 2)          # unit 0 runs twice per pass (a shared block)
    cursor.start_pass()
    assert cursor.enter(1) is False and cursor.position == 2
    assert cursor.enter(0) is True and cursor.position == 3
    assert cursor.enter(2) is True
    assert cursor.enter(7) is False and cursor.position == 4   # never recorded: stays
    assert cursor.resyncs == 2


def test_upcoming_wraps_into_the_next_pass_skips_the_root_and_stops_after_one_pass():
    cursor = recorded(0, 1, 2)
    assert list(cursor.upcoming(2)) == [1, 2, 0]
    assert list(cursor.upcoming(0)) == [0, 1, 2]
    assert list(TraceCursor().upcoming(0)) == []


def test_a_pass_that_ran_a_unit_the_trace_lacks_becomes_the_trace():
    cursor = recorded(0, 1, 4)             # the recording pass routed to experts 0 and 1
    cursor.start_pass()
    for index in (2, 3, 4):                # this pass routes to 2 and 3
        cursor.enter(index)
    assert cursor.end_pass() is True and cursor.steps == [ROOT, 2, 3, 4] and cursor.retraces == 1
    cursor.start_pass()
    assert [cursor.enter(i) for i in (2, 3, 4)] == [True, True, True]
    assert cursor.end_pass() is False


def test_a_pass_that_only_skipped_units_leaves_the_trace():
    cursor = recorded(0, 1, 2, 3)
    cursor.start_pass()
    for index in (0, 1):                   # an early exit
        cursor.enter(index)
    assert cursor.end_pass() is False and cursor.steps == [ROOT, 0, 1, 2, 3] and cursor.retraces == 0


def run(cursor, indices, ending=TraceCursor.end_pass):
    cursor.start_pass()
    for index in indices:
        cursor.enter(index)
    return ending(cursor)


def test_an_order_that_changed_for_good_becomes_the_trace_at_its_second_pass():
    """A block dropped or two swapped for good: a pass that only skipped or reordered kept
    the recorded trace, so every later pass missed the same units, for good."""
    cursor = recorded(0, 1, 2, 3)
    assert run(cursor, (0, 2, 1, 3)) is False             # once: maybe a branch, kept
    assert run(cursor, (0, 2, 1, 3)) is True and cursor.steps == [ROOT, 0, 2, 1, 3]
    resyncs = cursor.resyncs
    assert run(cursor, (0, 2, 1, 3)) is False and cursor.resyncs == resyncs    # followed, no resync
    assert run(cursor, (0, 2, 3)) is False                # dropped unit 1: once kept...
    assert run(cursor, (0, 2, 3)) is True and cursor.steps == [ROOT, 0, 2, 3]
    # ...while orders that alternate (early exits of varying depth) never replace it
    cursor = recorded(0, 1, 2, 3)
    for indices in [(0,), (0, 1), (0,), (0, 1, 2)] * 2:
        assert run(cursor, indices) is False
    assert cursor.steps == [ROOT, 0, 1, 2, 3] and cursor.retraces == 0


def abandoned(cursor, indices):
    """A pass that raised at the last of `indices` (strict=True's miss there)."""
    return run(cursor, indices, TraceCursor.abandon_pass)


def test_a_pass_cut_short_counts_as_its_order_then_the_traces_from_there():
    """strict=True raises at the first unit out of order, so a dropped block never reached
    end_pass: the trace was never adopted and every pass raised there, for good."""
    cursor = recorded(0, 1, 2, 3)
    assert abandoned(cursor, (0, 2)) is False              # unit 1 dropped: once kept...
    assert abandoned(cursor, (0, 2)) is True and cursor.steps == [ROOT, 0, 2, 3]
    assert run(cursor, (0, 2, 3)) is False and cursor.abandon_pass() is False   # ended: nothing to do
    # an error part-way through a pass in the trace's order changes nothing
    assert abandoned(cursor, (0,)) is False and abandoned(cursor, (0,)) is False
    assert cursor.steps == [ROOT, 0, 2, 3] and cursor.retraces == 1


def test_passes_of_two_kinds_each_follow_their_own_order():
    """An encoder-decoder generating: the encoder and decoder once (0 1 then 2 3), then the
    decoder alone (2 3) for each further token, call after call. One trace fits neither
    kind: every switch of kind resynced and adopted the other order, twice per call. Each
    kind keeps its own order; a pass's end makes the trace the order that most often
    followed its kind, so once a call has shown which follows which, only the first pass
    of each call (which no order predicts) starts off the trace, and it resyncs nothing."""
    cursor = recorded(0, 1, 2, 3)
    run(cursor, (2, 3))
    run(cursor, (2, 3))                                   # the decoder's order, adopted
    assert cursor.steps == [ROOT, 2, 3]
    run(cursor, (0, 1, 2, 3))                             # a first call: no resync, ...
    for _ in range(5):
        run(cursor, (2, 3))
    assert cursor.resyncs == 2                            # (the two decoder passes above)
    for _ in range(3):                                    # ...and the next ones, predicted
        resyncs = cursor.resyncs
        cursor.start_pass()
        assert [cursor.enter(i) for i in (0, 1, 2, 3)] == [True] * 4 and cursor.switched is False
        assert cursor.end_pass() is True and cursor.steps == [ROOT, 2, 3]   # the decoder comes next
        for _ in range(5):
            assert run(cursor, (2, 3)) is False and cursor.steps == [ROOT, 2, 3]
        assert cursor.resyncs == resyncs
    assert cursor.retraces == 1


def test_a_pass_that_begins_another_known_order_switches_to_it_without_a_resync():
    cursor = recorded(0, 1, 2, 3)
    run(cursor, (2, 3))
    run(cursor, (2, 3))
    cursor.start_pass()
    assert cursor.enter(0) is True and cursor.switched and cursor.steps == [ROOT, 0, 1, 2, 3]
    assert cursor.enter(1) is True and not cursor.switched and cursor.position == 2
    assert cursor.resyncs == 2                            # the (2, 3) passes before it was adopted
    assert list(cursor.upcoming(3)) == [2, 3, 0, 1]


def test_models_whose_passes_all_begin_alike_keep_one_order():
    cursor = recorded(0, 1, 2, 3)
    for indices in [(0,), (0, 1), (0, 1, 2, 3)] * 3:      # early exits: one kind of pass
        run(cursor, indices)
    assert cursor.steps == [ROOT, 0, 1, 2, 3] and cursor.retraces == 0 and len(cursor._orders) == 1
