"""The connection guard's waiting pool (prefetchd.control.idle_room), driven without
sockets: who waits over a budget, who is pushed out, who gives way."""
import time

from prefetchd.control.idle_room import IdleRoom

A, B = ("pid", 100, 0), ("pid", 200, 0)


def test_the_peer_with_the_most_waiting_gives_up_its_oldest_first():
    # Oldest-of-all first, thousands of idle sockets reconnecting from one process pushed a
    # client's connection out between its connect and its first request (an outside probe).
    room = IdleRoom(5.0, None, waiting_budget=4)
    assert room.wait(1, A) == [] and room.wait(2, B) == [] and room.wait(3, A) == []
    assert room.wait(4, A) == []
    pushed = [room.wait(fd, A)[0] for fd in range(5, 50)]     # A reconnecting, over and over
    assert pushed == [1, 3, 4] + list(range(5, 47)), pushed
    assert 2 in room.waiting                                  # B's connection never went
    assert room.wait(50, B) == [47]                           # A still holds the most
    assert sorted(room.waiting) == [2, 48, 49, 50]


def test_a_live_connection_gives_way_only_idle_and_answered():
    busy = set()
    room = IdleRoom(0.2, lambda: busy, waiting_budget=4)
    for fd in (1, 2, 3):
        room.saw(fd)
    room.never_idle(3)                                        # an events subscriber
    assert room.victim([1, 2, 3]) is None                     # none idle long enough yet
    time.sleep(0.25)
    room.saw(2)
    busy.add(1)
    assert room.victim([1, 2, 3]) is None                     # 1 has a request unanswered
    busy.clear()
    assert room.victim([1, 2, 3]) == 1
    room.forget(1)
    assert room.victim([2, 3]) is None


def test_without_idle_after_nothing_waits_and_nothing_gives_way():
    room = IdleRoom(None, None, waiting_budget=4)
    room.saw(1)
    assert not room.may_wait(2) and room.victim([1]) is None
