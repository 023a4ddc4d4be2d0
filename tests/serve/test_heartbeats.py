"""prefetchd.serve.heartbeat, without threads or sockets: a worker silent for the timeout
while the front listened is hung; time the front's own loop spent away (one message of six
million frames took it 35 s to receive) is not the workers' silence: it killed both healthy
workers of an outside probe's front."""
from types import SimpleNamespace

from prefetchd.serve.heartbeat import Heartbeats


def _slot(index):
    return SimpleNamespace(index=index, ready=True)


def test_a_worker_silent_while_the_front_listens_is_hung():
    beats, slot = Heartbeats(interval=1.0, timeout=15.0), _slot(0)
    beats.on_ready(slot, now=0.0)
    for second in range(1, 16):                      # the loop looks every second
        beats.attend(float(second))
        assert beats.hung([slot], float(second)) == []
    beats.attend(16.0)
    assert beats.hung([slot], 16.0) == [slot]


def test_the_time_the_front_was_away_is_not_counted_against_the_workers():
    beats, slots = Heartbeats(interval=1.0, timeout=15.0), [_slot(0), _slot(1)]
    for s in slots:
        beats.on_ready(s, now=0.0)
    beats.attend(0.5)
    beats.attend(36.0)                               # 35 s receiving one message
    assert beats.hung(slots, 36.0) == []
    beats.heard(slots[0], rid=b"r", now=36.1)        # worker 0's queued reply is read
    for second in range(37, 52):
        beats.attend(float(second))
    assert beats.hung(slots, 51.0) == [slots[1]]    # worker 1 stayed silent for 15 s of listening


def test_a_reply_read_in_the_round_the_front_was_away_is_not_moved_into_the_future():
    # The loop drains the replies (heard) before its timers (attend): the time away was
    # added to a fresh reply, and a worker hung after it was found 35 s late.
    beats, slot = Heartbeats(interval=1.0, timeout=15.0), _slot(0)
    beats.on_ready(slot, now=0.0)
    beats.attend(0.5)
    beats.heard(slot, rid=b"r", now=35.9)            # drained first, in the round that took 35 s
    beats.attend(36.0)
    for second in range(37, 53):                     # then it hangs
        beats.attend(float(second))
    assert beats.hung([slot], 52.0) == [slot]        # 16 s of listening after its last reply

