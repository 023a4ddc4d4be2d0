"""Ctrl-C, over and over, in a forward while other threads run the same model (a child of
test_hooks.py's Ctrl-C test: _thread.interrupt_main raises KeyboardInterrupt in this
process's main thread, at whatever bytecode it reaches, as a real Ctrl-C does).

argv: store_dir seconds. Prints one JSON line: interrupts, passes, wrong outputs, errors,
threads still running, pinned tensors after; exits 0.
"""
import _thread
import json
import random
import signal
import sys
import threading
import time

import mindspore as ms
import numpy as np

import prefetchd

store_dir, seconds = sys.argv[1], float(sys.argv[2])
ms.set_device("CPU")
nn = ms.nn


def build():
    ms.set_seed(0)
    return nn.SequentialCell([nn.Dense(16, 256)] + [nn.SequentialCell([nn.Dense(256, 256), nn.ReLU()])
                                                     for _ in range(8)] + [nn.Dense(256, 8)])


model, x = build(), ms.Tensor(np.random.default_rng(1).standard_normal((32, 16)).astype(np.float32))
want = build()(x).asnumpy()
daemon = prefetchd.Daemon(device_budget=sum(p.nbytes for p in model.get_parameters()) // 3,
                          store_dir=store_dir).start()
prefetchd.offload(model, daemon, lookahead=1)
model(x)
stop, wrong, errors, passes = threading.Event(), [], [], [0]


def worker():
    while not stop.is_set():
        try:
            wrong.extend(["worker"] if not np.array_equal(model(x).asnumpy(), want) else [])
            passes[0] += 1
        except Exception as e:            # noqa: BLE001 - reported
            errors.append(f"{type(e).__name__}: {e}"[:200])


threads = [threading.Thread(target=worker, daemon=True) for _ in range(2)]
for t in threads:
    t.start()
interrupts, rng, end = 0, random.Random(0), time.monotonic() + seconds
while True:
    try:                      # everything in here: the interrupt lands at any bytecode
        if time.monotonic() >= end:
            signal.signal(signal.SIGINT, signal.SIG_IGN)   # an interrupt still pending: dropped
            break
        timer = threading.Timer(rng.uniform(0.0, 0.2), _thread.interrupt_main)
        timer.start()
        try:
            while True:
                wrong.extend(["main"] if not np.array_equal(model(x).asnumpy(), want) else [])
        finally:
            timer.join()
    except KeyboardInterrupt:
        interrupts += 1
stop.set()
for t in threads:
    t.join(60)
final = np.array_equal(model(x).asnumpy(), want)
# Unpins are queued (Daemon.unpin): the scheduler applies the last pass's a moment later,
# later still on a loaded machine. A pin left for good stays past this bound.
settle = time.monotonic() + 5.0
while daemon.status()["pinned"] and time.monotonic() < settle:
    time.sleep(0.05)
print(json.dumps({"interrupts": interrupts, "passes": passes[0], "wrong": len(wrong), "errors": errors[:3],
                  "alive": sum(t.is_alive() for t in threads), "pinned": daemon.status()["pinned"],
                  "final_equal": bool(final)}), flush=True)
daemon.close()
