"""Concurrency and shutdown under stress: many producers, random evictions, watermark
changes, and close() in the middle — no deadlock, no hang, no leak."""
import random
import threading
import time

import numpy as np
import pytest

from prefetchd import Daemon
from prefetchd.errors import PrefetchdError, ShutdownError

KiB = 1 << 10


@pytest.mark.parametrize("seed", range(3))
def test_close_in_the_middle_of_a_storm(store_dir, ms, no_leaks, seed):
    rng = random.Random(seed)
    d = Daemon(store_dir=store_dir, device_budget="2MiB", shutdown_timeout=5).start()
    params = [ms.Parameter(ms.Tensor(np.full(rng.choice([4, 16, 64]) * KiB // 4, i, np.float32)), name=f"s{i}")
              for i in range(24)]
    for i, p in enumerate(params):
        d.register(p, tier=("remote", "host", "device")[i % 3])
    futures, refused, unexpected = [], [], []
    stop = threading.Event()

    def producer(tid):
        r = random.Random(seed * 100 + tid)
        while not stop.is_set():
            name = params[r.randrange(len(params))].name
            try:
                op = r.random()
                if op < 0.4:
                    futures.append(d.prefetch(name, priority=r.randrange(4)))
                elif op < 0.6:
                    futures.append(d.evict(name))
                elif op < 0.8:
                    with d.use(name):
                        pass
                elif op < 0.9:
                    futures.append(d.flush())
                else:
                    futures.append(d.set_watermarks(r.choice([0.5, 0.8, 1.0]), None))
            except ShutdownError:
                refused.append(1)
                return
            except PrefetchdError:
                pass
            except Exception as e:      # anything else is a bug
                unexpected.append(repr(e))
                return

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.5 + rng.random())
    started = time.monotonic()
    d.close(timeout=5)
    closed_in = time.monotonic() - started
    stop.set()
    for t in threads:
        t.join(10)
        assert not t.is_alive(), "a producer hung after close()"
    assert closed_in < 7, f"close() took {closed_in:.1f}s with a 5s bound"
    assert not unexpected, unexpected
    for f in futures:
        assert f.done(), "a future was left pending after close()"
    with pytest.raises(ShutdownError, match="after close"):
        d.prefetch(params[0].name)
