"""Which units a streamed pass prefetches (prefetchd/hooks/passes.py, StreamingPass.prefetch_from):
the next unit, then the next `lookahead` units whose loads move bytes (disk reads, copies),
looking past units that load by a page move, then the page-move units within `lookahead`;
all within the room beside the pinned units. A fake session says which units move bytes,
so no daemon and no MindSpore run here."""
from concurrent.futures import Future

import pytest

from prefetchd.hooks.passes import WINDOW_SCAN_PAST, StreamingPass
from prefetchd.hooks.trace_cursor import ROOT, TraceCursor

UNIT = 100


class Unit:
    def __init__(self, index):
        self.index, self.name, self.nbytes, self.held = index, f"u{index}", UNIT, False
        self.records = (f"r{index}",)


class Pins:
    def __init__(self, n):
        self.units = [Unit(i) for i in range(n)]


class Session:
    """Records prefetches; `disk` are the units whose loads move bytes."""

    def __init__(self, disk):
        self.disk, self.prefetched = set(disk), []

    def moves_bytes(self, units):
        return [int(records[0][1:]) in self.disk for records in units]

    def prefetch(self, records, priority=0):
        self.prefetched.append((int(records[0][1:]), priority))
        f = Future()
        f.set_result(None)
        return f


def streaming(n, disk, lookahead, slots):
    cursor = TraceCursor()
    cursor.steps = [ROOT, *range(n)]
    session = Session(disk)
    p = StreamingPass(cursor, session, Pins(n), estimator=None, lookahead_of=lambda: lookahead,
                      high_of=lambda: slots * UNIT, auto_fetch=True, publish=lambda: None)
    return p, session


def prefetched(n, disk, lookahead, slots, start, pinned_units=1):
    p, session = streaming(n, disk, lookahead, slots)
    p.prefetch_from(start, pinned_units * UNIT)
    return [i for i, _ in session.prefetched]


def test_every_unit_moving_bytes_is_the_plain_lookahead():
    # Disk reads (or copies) everywhere: the next `lookahead` units, nearest first.
    assert prefetched(8, range(8), lookahead=2, slots=8, start=2) == [1, 2]
    assert prefetched(8, range(8), lookahead=3, slots=8, start=2) == [1, 2, 3]


def test_page_moves_everywhere_are_the_plain_lookahead_too():
    # Nothing moves bytes (a host tier on cpu): the next `lookahead` units, as before.
    assert prefetched(8, (), lookahead=2, slots=8, start=2) == [1, 2]


def test_reads_get_the_room_before_page_moves():
    # Units 0, 2, 4, ... read from disk, 1, 3, 5, ... page moves (a spread host cache).
    # Computing unit 0 (pinned): the next unit (1), then the reads 2 and 4 as room allows;
    # the page move 3 needs no lead time and waits for a later call.
    disk = range(0, 8, 2)
    assert prefetched(8, disk, lookahead=2, slots=3, start=2) == [1, 2]
    assert prefetched(8, disk, lookahead=2, slots=4, start=2) == [1, 2, 4]
    assert prefetched(8, disk, lookahead=2, slots=8, start=2) == [1, 2, 4]
    # With lookahead 3 the page move 3 is within it: placed after the reads, room allowing.
    assert prefetched(8, disk, lookahead=3, slots=6, start=2) == [1, 2, 4, 6, 3]
    assert prefetched(8, disk, lookahead=3, slots=5, start=2) == [1, 2, 4, 6]


def test_priorities_fall_with_distance():
    p, session = streaming(8, range(0, 8, 2), lookahead=2, slots=8)
    p.prefetch_from(2, UNIT)
    assert session.prefetched == [(1, 2), (2, 1), (4, -1)]


def test_the_window_wraps_into_the_next_pass_and_stops_at_the_scan_bound():
    assert prefetched(8, {0, 1}, lookahead=2, slots=8, start=7) == [6, 0, 1, 7]
    scan = 2 * 1 + WINDOW_SCAN_PAST                   # lookahead 1
    assert prefetched(16, {scan - 1}, lookahead=1, slots=16, start=1) == [0, scan - 1]
    # a read past the scan bound waits for the window to come closer
    assert prefetched(16, {scan}, lookahead=1, slots=16, start=1) == [0]


@pytest.mark.parametrize("lookahead", [0])
def test_lookahead_zero_prefetches_nothing(lookahead):
    assert prefetched(8, range(8), lookahead=lookahead, slots=8, start=2) == []
