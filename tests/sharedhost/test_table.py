"""The shared tier's block table without sockets or threads: leases pin blocks, a closed
connection gives back every lease it held, and room is made only from idle ready blocks."""
import collections

from prefetchd.sharedhost.table import BlockTable


class FakeBlock:
    def __init__(self, key, size):
        self.key, self.version, self.size, self.closed = key, 1, size, False

    def close(self):
        self.closed = True


class Conn:
    def __init__(self):
        self.leases = collections.Counter()


def _ready(table, key, size):
    entry = table.add((key, 1), FakeBlock(key, size))
    entry.ready = True
    return entry


def test_a_leased_block_is_never_dropped_for_room():
    table, conn = BlockTable(100, collections.Counter()), Conn()
    a = _ready(table, "a", 60)
    table.lease(conn, ("a", 1), a)
    assert not table.make_room(60, [])          # only a leased block could make room
    assert not a.block.closed and table.get(("a", 1)) is a
    assert table.unlease(conn, ("a", 1))
    assert table.make_room(60, []) and a.block.closed and table.get(("a", 1)) is None


def test_a_closed_connection_releases_every_lease_and_stops_waiting():
    table, conn, other = BlockTable(100, collections.Counter()), Conn(), Conn()
    a = _ready(table, "a", 10)
    b = table.add(("b", 1), FakeBlock("b", 10))      # still filling
    for _ in range(3):
        table.lease(conn, ("a", 1), a)
    table.lease(conn, ("b", 1), b)
    b.waiters.append((conn, 0))
    table.lease(other, ("a", 1), a)
    assert table.release_all(conn) == 4
    assert a.leases == 1 and b.leases == 0 and b.waiters == [] and not conn.leases
    assert table.summary() == {"bytes": 20, "blocks": 1, "filling": 1, "leases": 1}


def test_a_release_not_held_is_refused_and_changes_nothing():
    table, conn = BlockTable(100, collections.Counter()), Conn()
    a = _ready(table, "a", 10)
    assert not table.unlease(conn, ("a", 1))
    assert a.leases == 0


def test_room_is_made_only_as_far_as_needed():
    counters = collections.Counter()
    table = BlockTable(100, counters)
    blocks = [_ready(table, k, 30) for k in "abc"]
    assert table.make_room(30, [])
    assert sum(e.block.closed for e in blocks) == 1 and counters["evictions"] == 1
    assert table.used() == 60
