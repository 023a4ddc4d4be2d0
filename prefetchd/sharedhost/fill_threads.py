"""The threads that fill shared blocks from the store: daemon threads, so that a read stuck in
the kernel (a hung disk) holds neither the owner's close() nor the process's exit.
(concurrent.futures.ThreadPoolExecutor joins its threads at interpreter exit, without bound.)
"""
import concurrent.futures
import queue
import threading

_STOP = object()


class FillThreads:
    """`submit(fn, *args)` -> a concurrent.futures.Future run by one of `n` daemon threads, in
    submission order. `shutdown()` cancels what has not started and lets the threads end once
    their current call returns; it waits for nothing: `wait(timeout)` does, bounded."""

    def __init__(self, n, name):
        self._work = queue.SimpleQueue()
        self._stopped = False
        self._pending = set()          # futures not done
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn, *args):
        if self._stopped:
            raise RuntimeError("cannot submit after shutdown")
        future = concurrent.futures.Future()
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        self._work.put((future, fn, args))
        return future

    def wait(self, timeout):
        """How many submitted calls are still not done after waiting up to `timeout` seconds."""
        _, not_done = concurrent.futures.wait(list(self._pending), timeout)
        return len(not_done)

    def shutdown(self):
        self._stopped = True
        for _ in self._threads:
            self._work.put(_STOP)

    def _run(self):
        while True:
            item = self._work.get()
            if item is _STOP:
                return
            future, fn, args = item
            if self._stopped:                    # cancelled: shut down before it started
                future.cancel()
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:           # (fn reports its own errors; kept for wait())
                future.set_exception(e)
