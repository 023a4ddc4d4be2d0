"""A daemon process attached to a shared host tier (tests/sharedhost): loads every
tensor of the store `rounds` times through a device tier smaller than the model and
checks each load bit-equal to the values the test wrote.

argv[1]: JSON {"store", "socket" (null: private host tier), "device_budget", "host_budget",
"tensors": {name: [seed, count]}, "rounds" (0: until stdin closes)}.
stdout, one JSON line each: {"ready": ...} once started, {"done": ...} after the rounds;
then it waits for stdin to close (so the test can measure it alive) and exits.
"""
import json
import sys

import numpy as np


def values(seed, count):
    return np.random.default_rng(seed).standard_normal(count).astype(np.float32)


def proc_numbers():
    with open("/proc/self/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    with open("/proc/self/smaps_rollup") as f:
        pss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    return {"read_bytes": int(io["read_bytes"]), "pss": pss}


def say(**obj):
    print(json.dumps(obj), flush=True)


def main():
    args = json.loads(sys.argv[1])
    from prefetchd.daemon import Daemon
    d = Daemon(store_dir=args["store"], shared_host=args["socket"], device_budget=args["device_budget"],
               host_budget=args["host_budget"], policy="lru").start()
    expected = {name: values(*spec) for name, spec in args["tensors"].items()}
    handles = {name: d.register_remote(name, a.shape, a.dtype) for name, a in expected.items()}
    import mindspore  # noqa: F401  (the first use() imports it: not part of what a load costs)
    say(ready=proc_numbers())
    loads = wrong = 0
    r = 0
    while args["rounds"] == 0 or r < args["rounds"]:
        for name, h in handles.items():
            with d.use([h]) as recs:
                got = np.frombuffer(recs[0].home, np.float32, count=expected[name].size)
                loads += 1
                wrong += not np.array_equal(got, expected[name])
            d.evict([h]).result(30)
        r += 1
    status = d.status()
    say(done={**proc_numbers(), "loads": loads, "wrong": wrong, "shared": status["shared_host"],
              "loads_from": status["loads_from"]})
    sys.stdin.read()
    d.close(10)


if __name__ == "__main__":
    main()
