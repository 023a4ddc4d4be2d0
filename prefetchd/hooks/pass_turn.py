"""Whose turn it is to run an offloaded model's pass: one thread at a time.

A thread takes the turn in the model's forward pre-hook and gives it back in the
model's `always_call` forward hook. MindSpore runs `always_call` hooks when the
forward raised an Exception, but not a BaseException: a Ctrl-C (KeyboardInterrupt)
or a SystemExit inside the forward leaves the turn taken by a thread that is no
longer inside the model, and every other thread calling it waited for good (the
process could not even exit). So a waiting thread looks, every `POLL` seconds,
whether the holder is still inside one of the model's calls (its Python stack,
`sys._current_frames`), and takes the turn over if it is not. The holder's own
next call runs through, as a nested call always did (the pre-hook starts a pass).
Only a pass is taken over: a block run between passes (`held()`, e.g.
prefetchd.load_param_into_net) is rightly outside the model, and gives the turn
back in its `finally`. Taking the lock and naming its holder, and the reverse, run
with SIGINT held off (hooks/interrupts.py): a Ctrl-C in between left a lock that
nobody held.
"""
import contextlib
import sys
import threading

from ..core.waits import refuse_wait_on_scheduler
from ..errors import PrefetchdError
from .interrupts import sigint_deferred

POLL = 0.05      # seconds between looks at the holder while waiting


def _call_codes():
    from ..backend.framework import mindspore
    cell = mindspore().nn.Cell
    return {cell.__call__.__code__, cell._run_construct.__code__}


class PassTurn:
    """The turn of `model`'s passes. `on_abandoned()` runs, on the thread taking over,
    before a pass that a BaseException cut short is replaced by a new one."""

    def __init__(self, model, on_abandoned):
        self._model = model
        self._on_abandoned = on_abandoned
        self._lock = threading.Lock()    # held from the pre-hook to the end of the pass
        self._mutex = threading.Lock()   # makes reading and changing `holder` one step
        self._codes = _call_codes()
        self.holder = None               # ident of the thread whose turn it is, or None
        self._in_pass = False            # the holder's turn is a pass (not a `held()` block)
        self._opener = model             # the cell whose call opened the pass (hooks/outer_calls.py)

    def held_here(self):
        """Whether the calling thread has the turn (inside a pass, or a `held()` block)."""
        return self.holder == threading.get_ident()

    def take(self, in_pass=True, opener=None):
        """Wait for the turn (the model's pre-hook, or `opener`'s: a cell of it called outside
        its forward). The holder's own call runs through."""
        me = threading.get_ident()
        opener = self._model if opener is None else opener
        if self.holder == me:
            self._opener = opener          # (the same; or this thread's pass, cut short, goes on as this one)
            return
        while True:
            with sigint_deferred():        # the lock and its holder's name go together
                if self._lock.acquire(timeout=POLL):
                    with self._mutex:
                        self.holder, self._in_pass, self._opener = me, in_pass, opener
                    return
                with self._mutex:
                    # Only a pass can be cut short unseen: a held() block gives the turn back
                    # in its `finally`, and its thread is rightly outside the model meanwhile.
                    if self.holder is not None and self._in_pass and not self._inside(self.holder):
                        self._on_abandoned()
                        # the lock stays held: ours now
                        self.holder, self._in_pass, self._opener = me, in_pass, opener
                        return
            # On a scheduler thread (a future's callback, a listener) the holder's pass may be
            # waiting for this very thread to settle its loads: waiting here deadlocked both.
            refuse_wait_on_scheduler("waiting for another thread's forward of an offloaded model")

    def give(self):
        """End this thread's turn (the model's always_call forward hook); no-op for others."""
        with sigint_deferred(), self._mutex:
            if self.holder != threading.get_ident():
                return
            self.holder, self._in_pass = None, False
            self._lock.release()

    @contextlib.contextmanager
    def held(self):
        """The turn, for a block run between passes; refused inside one of the model's forwards."""
        me = threading.get_ident()
        if self.holder == me:
            if self._inside(me):
                raise PrefetchdError("refused inside this model's forward: run it between forwards")
            self._on_abandoned()             # this thread's own pass, cut short by a BaseException
            self._in_pass = False
        else:
            self.take(in_pass=False)
        try:
            yield
        finally:
            self.give()

    def within(self, cell):
        """Whether the calling thread is inside a call of `cell`."""
        return self._inside(threading.get_ident(), cell)

    def _inside(self, ident, cell=None):
        """Is thread `ident` inside a call of `cell`, by default of the cell that opened its
        pass (the model, or one of its cells called alone); False if gone or left it?"""
        cell = self._opener if cell is None else cell
        frame = sys._getframe() if ident == threading.get_ident() else sys._current_frames().get(ident)
        while frame is not None:
            if frame.f_code in self._codes and frame.f_locals.get("self") is cell:
                return True
            frame = frame.f_back
        return False
