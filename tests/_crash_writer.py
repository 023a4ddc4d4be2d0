"""Child process of the crash test: write-backs to a store until killed.

argv: STORE_DIR KEYS SEED FIRST_VERSION [verify]. Prints "begin KEY VERSION"
before each write and "ack KEY VERSION" once write_sync returned (durable),
flushing each. With "verify", each write is read back checksum-verified before
its ack, like the daemon's write-back: the previous version of the key stays
on disk until that read succeeds (a short pause widens that window).
"""
import random
import sys
import time

import numpy as np

from prefetchd import _native


def value(key, version, nbytes):
    """Deterministic content of (key, version); the version is in the first 8 bytes."""
    rng = np.random.default_rng([key, version])
    data = rng.integers(0, 256, nbytes, dtype=np.uint8)
    data[:8] = np.frombuffer(np.int64(version).tobytes(), np.uint8)
    return data


def size_of(key):
    return 4096 * (1 + key % 5) + 1000 * key     # aligned and unaligned sizes


def main():
    directory, keys, seed, version = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    verify = sys.argv[5:] == ["verify"]
    store = _native.FileStore(directory)
    rng = random.Random(seed)
    while True:
        key = rng.randrange(keys)
        print(f"begin {key} {version}", flush=True)
        store.write_sync(f"t{key}", value(key, version, size_of(key)), -1, b"")
        if verify:
            time.sleep(0.01)
            store.read_sync(f"t{key}", _native.aligned_buffer(size_of(key)), True)
        print(f"ack {key} {version}", flush=True)
        version += 1


if __name__ == "__main__":
    main()
