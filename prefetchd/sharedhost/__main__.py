"""`python -m prefetchd.sharedhost --socket PATH --store DIR --budget SIZE`: run an owner
of a shared host tier for standalone daemons (their config: shared_host = PATH) until
SIGTERM/SIGINT. `prefetchd serve` runs its own owner in the front instead."""
import argparse
import logging
import signal
import threading

from ..config import ConfigError, parse_size
from .owner import SharedHostOwner


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m prefetchd.sharedhost", description=__doc__)
    ap.add_argument("--socket", required=True, help="Unix socket path the daemons attach to")
    ap.add_argument("--store", required=True, help="FileStore directory holding the served tensors")
    ap.add_argument("--budget", required=True, help="bytes of host RAM for shared blocks (e.g. 8GiB)")
    ap.add_argument("--log-level", default="INFO")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        budget = parse_size(args.budget, "--budget")
    except ConfigError as e:
        ap.error(str(e))
    from .. import _native
    try:
        owner = SharedHostOwner(args.socket, args.store, budget).start()
    except (ConfigError, OSError, _native.NativeError) as e:     # one line, as every refusal
        ap.exit(1, f"{ap.prog}: error: {e}\n")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"READY {args.socket}", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        owner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
