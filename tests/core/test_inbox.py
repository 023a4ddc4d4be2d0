"""The scheduler's inbox (prefetchd/core/inbox.py): requests queued behind one that has not
been taken yet ride on its wake-up; the one that finds the inbox empty always wakes it."""
import threading

import pytest

from prefetchd.core.inbox import Inbox
from prefetchd.core.requests import Kind, Request
from prefetchd.errors import ShutdownError


class _Backend:
    def __init__(self):
        self.notifies = 0

    def notify(self):
        self.notifies += 1


def test_only_the_request_that_finds_the_inbox_empty_wakes_the_scheduler():
    backend = _Backend()
    inbox = Inbox(threading.Lock(), backend)
    for _ in range(3):
        inbox.submit(Request(Kind.UNPIN, []))
    assert backend.notifies == 1 and len(inbox) == 3
    assert [inbox.popleft().seq for _ in range(3)] == [0, 1, 2]     # in the order numbered
    inbox.submit(Request(Kind.UNPIN, []))                            # empty again: wakes it
    assert backend.notifies == 2
    inbox.shut_down(0.0)                                             # the sentinel always wakes it
    assert backend.notifies == 3
    inbox.refuse_new("closing")
    with pytest.raises(ShutdownError, match="closing"):
        inbox.submit(Request(Kind.UNPIN, []))
