"""Run by tests/native/test_compute_marker.py in its own process: a broken MindSpore op
queue stays broken for the life of the process, so this must not share one.

Threads meet at a barrier, then each builds a compute marker (or a daemon's
first `use`) at the same moment and marks from its own thread. Prints one JSON
line: what each thread saw, and whether MindSpore can still synchronize.

MindSpore 2.10 cannot take ops from two threads at once, of any kind: PyNative
pushes every op (plain or custom) into one single-producer queue without a lock
(docs/mindspore-notes.md). prefetchd's own dispatches (a marker's probe, `mark`)
go through its one op lock; the test's ops go through OPS, a different lock, so
they must never overlap prefetchd's (with `x * c` under OPS beside other
threads' marks, 2 runs of 15 at 40 rounds each aborted or hung). So each thread
computes the tensors it marks under OPS before the barrier, and after it only
prefetchd dispatches: building markers, marking, `use`.
"""
import json
import sys
import threading

import numpy as np
import mindspore as ms

from prefetchd import Daemon
from prefetchd.backend import framework

THREADS, ROUNDS, MARKS = 3, 4, 100
OPS = threading.Lock()      # the test's own MindSpore ops, one thread at a time


def markers_built_together():
    """Each round: THREADS markers built at once, then marked from their threads."""
    seen = []

    def one(barrier):
        try:
            with OPS:   # the tensors to mark, before any thread builds or marks
                x = ms.Tensor(np.ones((32, 32), np.float32))
                ys = [x * float(i) for i in range(MARKS)]
            barrier.wait(timeout=60)
            marker = framework.ComputeMarker()
            last = 0
            for y in ys:
                last = max(last, marker.mark(y))
            reached = marker.wait(last, 10.0)
            seen.append("ok" if reached >= last else f"stuck at {reached} of {last}")
        except Exception as e:
            seen.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    for _ in range(ROUNDS):
        barrier = threading.Barrier(THREADS)
        threads = [threading.Thread(target=one, args=(barrier,)) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return seen


def first_uses_together(store_dir):
    """A daemon's first `use` from several threads at once: one marker, every read right."""
    d = Daemon(store_dir=store_dir, device_budget="4MiB").start()
    try:
        params = [ms.Parameter(ms.Tensor(np.full(1024, k, np.float32)), name=f"p{k}") for k in range(THREADS)]
        for p in params:
            d.register(p, tier="remote")
        seen, barrier = [], threading.Barrier(THREADS)

        def one(k):
            # The first `use` builds the daemon's marker, whose probe is an op, while the
            # others wait for it inside `use`; nobody takes OPS before its `use` returned,
            # so the probe overlaps none of the test's ops.
            barrier.wait()
            try:
                with d.use(params[k].name):
                    with OPS:
                        value = params[k].asnumpy()[0]
                    seen.append("ok" if value == k else "wrong value")
            except Exception as e:
                seen.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
        threads = [threading.Thread(target=one, args=(k,)) for k in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        markers = {id(d.backend.compute_marker()) for _ in range(2)}
        return seen, d.backend.marker is not None and len(markers) == 1
    finally:
        d.close()


def main():
    markers = markers_built_together()
    uses, one_marker = first_uses_together(sys.argv[1])
    try:
        ms.hal.synchronize()
        synchronize = "ok"
    except Exception as e:
        synchronize = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    print(json.dumps({"markers": markers, "uses": uses, "one_marker": one_marker,
                      "synchronize": synchronize}))


if __name__ == "__main__":
    main()
