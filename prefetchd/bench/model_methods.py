"""The ways `prefetchd bench model` runs one model, each an object with one pass.

Every method has `one_pass()` (returns the output, or None), `counters()`
(cumulative numbers; the bench reports per-pass differences) and `close()`.
The bench interleaves their passes, so a method must leave nothing running
after its pass returns: the streamed ones wait until the prefetches their
post-hook issued for the next pass have landed (that time is part of the pass,
so no method gets an untimed head start).
"""
import time

import numpy as np

from .. import _native


def build(ms, hidden, layers, seed=0):
    """A stack of Dense(hidden, hidden) layers with fixed weights (the same for every method)."""
    from mindspore.nn.utils import no_init_parameters
    with no_init_parameters():
        model = ms.nn.SequentialCell([ms.nn.Dense(hidden, hidden) for _ in range(layers)])
    rng = np.random.default_rng(seed)
    for p in model.get_parameters():
        shape = tuple(p.shape)
        scale = 1.0 / np.sqrt(hidden) if len(shape) == 2 else 0.01
        p.set_data(ms.Tensor.from_numpy(rng.standard_normal(shape, dtype=np.float32) * scale))
    return model


def drain(daemon, timeout=120.0):
    """Wait until the daemon has nothing queued or in flight."""
    deadline = time.monotonic() + timeout
    while True:
        status = daemon.status()
        if not status["queue_depth"] and not status["in_flight"]:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"daemon {daemon.name} still busy after {timeout}s: {status}")
        time.sleep(0.0005)


def tlb_shootdowns():
    """TLB-shootdown interrupts received so far, summed over cores (/proc/interrupts' "TLB"
    line; 0 where the kernel shows none). Machine-wide: a page move's shootdown interrupts
    the cores running the process' other threads, and so does anything else running."""
    try:
        with open("/proc/interrupts") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name.strip() == "TLB":
                    return sum(int(field) for field in rest.split() if field.isdigit())
    except OSError:
        pass
    return 0


def daemon_counters(daemon):
    _status, s = daemon.snapshot()
    return {"tlb_shootdowns": tlb_shootdowns(), "rebinds": s.rebinds, "reclaims": s.reclaims,
            "loads_from": dict(s.loads_from), "load_bytes_from": dict(s.load_bytes_from), "stall_seconds": s.stall.sum,
            "host_drops": s.host_drops, "fences": s.fences,
            # how bytes reached the device tier (core/lending.py): with no copy (pages moved,
            # or unparked under the home) vs bytes copied
            "moved_bytes": s.moved_bytes, "copied_bytes": s.copied_bytes, "returned_bytes": s.returned_bytes,
            "unparked_bytes": s.unparked_bytes, "page_moves": s.page_moves, "page_protects": s.page_protects,
            "page_move_seconds": s.page_move_seconds}


class Resident:
    """Weights in framework memory, no prefetchd."""

    def __init__(self, ms, hidden, layers, x):
        self.model, self.x = build(ms, hidden, layers), x

    def one_pass(self):
        return self.model(self.x).asnumpy()

    def counters(self):
        return {"tlb_shootdowns": tlb_shootdowns()}

    def compute_profile(self, marker):
        """(dispatch_ns, fence_ns) per layer of one pass, from compute fences (cost.fence_clock.FenceClock)."""
        from ..cost.fence_clock import FenceClock
        clock = FenceClock(marker)
        dispatched = {}
        handles = []
        for cell in self.model:
            handles.append(cell.register_forward_pre_hook(
                lambda c, i: dispatched.__setitem__(id(c), time.monotonic_ns())))
            handles.append(cell.register_forward_hook(
                lambda c, i, out: clock.unit(marker.mark(out), dispatched[id(c)])))
        try:
            self.model(self.x).asnumpy()
        finally:
            for h in handles:
                h.remove()
        return clock.stop()

    def close(self):
        self.model = None


class Streamed:
    """The model offloaded through a daemon (lookahead 0: on demand, each layer loaded
    when it runs, like Accelerate's offload hooks; k: prefetchd)."""

    def __init__(self, ms, hidden, layers, x, *, tier, lookahead, device_budget, host_budget, store_dir, name):
        from ..daemon import Daemon
        from ..hooks.offload import offload
        self.model, self.x = build(ms, hidden, layers), x
        self.daemon = Daemon(device_budget=device_budget, host_budget=host_budget, store_dir=store_dir,
                             name=name).start()
        try:
            self.handle = offload(self.model, self.daemon, lookahead=lookahead, tier=tier, auto_fetch=True)
        except BaseException:
            self.daemon.close()
            raise

    def one_pass(self):
        out = self.model(self.x).asnumpy()
        drain(self.daemon)
        return out

    def counters(self):
        c = daemon_counters(self.daemon)
        c["misses"] = self.handle.stats()["misses"]
        return c

    def status(self):
        return self.daemon.status()

    def close(self):
        self.handle.close()
        self.daemon.close()


class IoOnly:
    """The same bytes moved by the same daemon machinery, nothing computed.

    Same config, tier, units and trace as the streamed model: per unit, prefetch
    the `lookahead` units after it, wait for it (pin) and let it go (unpin), so
    the host cache admits and keeps exactly what it keeps for the streamed model.
    The first pass loads on demand with no trace, like the hooks' recording pass.
    """

    def __init__(self, ms, hidden, layers, *, tier, lookahead, device_budget, host_budget, store_dir, name):
        from ..daemon import Daemon
        from ..hooks.offload import offload
        self.model = build(ms, hidden, layers)
        self.lookahead = lookahead
        self.daemon = Daemon(device_budget=device_budget, host_budget=host_budget, store_dir=store_dir,
                             name=name).start()
        try:
            # offload() plans and registers exactly as for the streamed model; the model never runs.
            self.handle = offload(self.model, self.daemon, lookahead=lookahead, tier=tier, auto_fetch=True)
        except BaseException:
            self.daemon.close()
            raise
        self.units = [u.records for u in self.handle.units if u.records]
        self.root = self.handle.root.records
        self._traced = False

    def one_pass(self):
        d, units, k = self.daemon, self.units, self.lookahead if self._traced else 0
        owner = "io-only"
        if self.root:
            d.pin(self.root).result()
        for i, recs in enumerate(units):
            if self._traced:
                d.advance_trace(i + 1, owner=owner)
            for j in range(i + 1, min(len(units), i + 1 + k)):
                d.prefetch(units[j], priority=k - (j - i) + 1)
            d.pin(recs).result()
            d.unpin(recs)
        if self.root:
            d.unpin(self.root)
        if not self._traced:
            d.set_trace([[r.name for r in self.root]] + [[r.name for r in u] for u in units], owner=owner)
            self._traced = True
        d.advance_trace(len(units), owner=owner)
        # Like the hooks' post-hook: the next pass's root and first units, inside this pass's time.
        if self.root:
            d.prefetch(self.root, priority=self.lookahead + 1)
        for j in range(min(len(units), self.lookahead)):
            d.prefetch(units[j], priority=self.lookahead - j)
        drain(d)
        return None

    def counters(self):
        return daemon_counters(self.daemon)

    def store_keys(self):
        """[[(name, nbytes)] per unit]: what the raw disk probe reads."""
        return [[(r.name, r.nbytes) for r in u] for u in self.units]

    def close(self):
        self.handle.close()
        self.daemon.close()


class DiskRead:
    """The store read the way it reads best: per unit, one read per tensor submitted
    back to back on a copy stream (each fanned out at the store's full queue depth,
    CRC32C verified), waited for once per unit. Gives the plan its disk rate."""

    def __init__(self, store, units):
        self.store, self.units = store, units
        self.stream = _native.Stream("bench-disk")
        # One destination per tensor of the largest unit (each as large as the largest
        # tensor), reused unit after unit: the probe needs no more memory than a unit.
        widest = max(len(u) for u in units)
        biggest = max(n for u in units for _, n in u)
        self._dst = [_native.aligned_buffer(biggest) for _ in range(widest)]
        self.nbytes = sum(n for u in units for _, n in u)
        self.seconds = []

    def one_pass(self):
        t = time.perf_counter()
        for unit in self.units:
            for (name, n), dst in zip(unit, self._dst):
                self.stream.read(self.store, name, dst, verify=True)
            self.stream.synchronize()
        self.seconds.append(time.perf_counter() - t)

    def counters(self):
        return {}

    def close(self):
        self.stream.close()


class HostCopy:
    """Host -> device-sized copies of the model's bytes, unit by unit, on a copy stream
    (what a load from the host cache costs on CPU: a memcpy). Gives the plan its h2d rate."""

    def __init__(self, unit_bytes):
        self.unit_bytes = unit_bytes
        self.stream = _native.Stream("bench-h2d")
        largest = max(unit_bytes)
        self.src = _native.aligned_buffer(largest)
        self.dst = _native.aligned_buffer(largest)
        np.frombuffer(self.src, np.uint8)[:] = 1
        np.frombuffer(self.dst, np.uint8)[:] = 0     # both touched: no page faults in the timing
        self.nbytes = sum(unit_bytes)
        self.seconds = []

    def one_pass(self):
        t = time.perf_counter()
        for n in self.unit_bytes:
            self.stream.copy(self.dst, self.src, n)
        self.stream.synchronize()
        self.seconds.append(time.perf_counter() - t)

    def counters(self):
        return {}

    def close(self):
        self.stream.close()
