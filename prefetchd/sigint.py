"""Ctrl-C stays Python's KeyboardInterrupt in a process that runs prefetchd.

MindSpore's runtime installs a native SIGINT handler at its first op
(libmindspore_runtime_pipeline.so) that ends the process with SIGTERM (exit 143):
no KeyboardInterrupt, no `finally`, no Daemon.close(), so weights written and not
yet written back are lost with the process, and the user's own cleanup never
runs. Python still believes its own handler is installed (`signal.getsignal`
says default_int_handler, or the user's own, or SIG_IGN), so the one Python names
is put back where prefetchd starts (Daemon.start(), offload(), Daemon.use()), as it
always was once a Ctrl-C was deferred (hooks/interrupts.py) in a first pass.
Signal handlers are set on the main thread only: a Daemon started elsewhere, and
MindSpore's first op after all of those, leave MindSpore's in place.
"""
import signal
import threading


def keep_keyboard_interrupt():
    """Put back the SIGINT handler Python believes installed (its default, the user's, SIG_IGN
    or SIG_DFL; None: one set outside Python, left alone). Main thread only: signal handlers
    can be set only there."""
    if threading.current_thread() is not threading.main_thread():
        return
    handler = signal.getsignal(signal.SIGINT)
    if handler is not None:
        signal.signal(signal.SIGINT, handler)
