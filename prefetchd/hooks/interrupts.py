"""Ctrl-C held off for a few lines that must run together.

Python raises KeyboardInterrupt in the main thread between any two bytecodes. Where
two steps must go together (a lock taken and its holder named; a unit's pins and its
`held` flag), one landing in between left the model locked, or pinned, for good. So
those few lines run with SIGINT recorded instead of handled, and the handler that was
there runs right after them (raising KeyboardInterrupt, by default). Never around a
wait that could last: Ctrl-C must still stop a stalled program.
"""
import contextlib
import signal
import threading


@contextlib.contextmanager
def sigint_deferred():
    """Run the block with SIGINT deferred to its end (main thread only: Python delivers
    signals there; on another thread nothing can interrupt the block)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):           # SIG_IGN, SIG_DFL, or not installed from Python
        yield
        return
    caught = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(*caught[0])
