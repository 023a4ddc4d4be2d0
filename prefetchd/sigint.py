"""Ctrl-C stays Python's KeyboardInterrupt in a process that runs prefetchd.

MindSpore's runtime installs a native SIGINT handler at its first op
(libmindspore_runtime_pipeline.so) that ends the process with SIGTERM (exit 143):
no KeyboardInterrupt, no `finally`, no Daemon.close(), so weights written and not
yet written back are lost with the process, and the user's own cleanup never
runs. Python still believes its own handler is installed (`signal.getsignal`
says default_int_handler), so it is put back where prefetchd starts, as it has
always been once a Ctrl-C was deferred (hooks/interrupts.py) in a first pass.
A handler the user installed from Python is left alone.
"""
import signal
import threading


def keep_keyboard_interrupt():
    """Put Python's SIGINT handler back if Python believes it is installed (main thread
    only: signal handlers can only be set there)."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
