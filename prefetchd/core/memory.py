"""Device memory: watermarks, reservations, victims and compute fences.

Invariant 1 (docs/design.md): bytes reserved on the device tier never exceed
the high watermark; crossing it evicts down to the low watermark
(hysteresis). Invariant 4: a block compute may still read is reused only
after a compute fence says that compute has finished.

Scheduler thread only, under the daemon's lock (which `fence_if` may release
while it waits for a whole-queue fence).
"""
from .. import _native
from ..errors import BudgetError
from . import lending
from .records import State


class DeviceMemory:
    def __init__(self, config, backend, registry, policy, stats, lock):
        self.config = config
        self.backend = backend
        self.registry = registry
        self.policy = policy
        self.stats = stats
        self._lock = lock
        self.high = config.high_watermark     # what reservations keep to
        self.low = config.low_watermark
        # What status reports: lags a lowering of (high, low) until the device tier is under
        # it (core/watermarks.py), so the bytes in use never exceed the high watermark reported.
        self.in_force = (self.high, self.low)
        self.peak = 0
        self.unfenced = []         # (block, compute epoch or None, record): released, maybe still read
        self.reserve_checks = []   # test hooks: fn(used_after, high) on every reservation
        self.evict = None          # fn(record, reason): the write-back path's (see connect)
        self.written_late = None   # fn(record, block): compute wrote a dropped replica before its fence

    def connect(self, *, evict, written_late):
        """The write-back path's moves, which need this memory themselves (so they come after)."""
        self.evict, self.written_late = evict, written_late

    # ------------------------------------------------------------------ queries
    def used(self):
        return self.backend.device_used()

    def above_high(self):
        """More in use than the high watermark: only after set_watermarks lowered it (no
        reservation goes past it), until the evictions it started have given blocks back."""
        return self.backend.device_used() > self.high

    def pinned_bytes(self):
        be = self.backend
        return sum(be.block_bytes(r.nbytes) for r in self.registry.pinned if r.block)

    def held_by_failed_writebacks(self):
        """"" or a clause saying which tensors are held because their write-back failed, the
        last error, and the remedy (they leave only once written back)."""
        failed = [r for r in self.registry if r.block is not None and r.writeback_failed]
        if not failed:
            return ""
        names = ", ".join(repr(r.name) for r in failed[:3])
        names += f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        return (f"; {len(failed)} held because their write-back failed ({names}; {failed[-1].error}): "
                f"fix the store (free space, permissions); a load that needs the room tries them again "
                f"(at most once a second), as does flush()")

    def check_fits(self, nbytes, name=None):
        """BudgetError if nbytes could never be reserved, even with everything else evicted."""
        need = self.backend.block_bytes(nbytes)
        what = f"{name!r} ({nbytes} bytes)" if name else f"{nbytes} bytes"
        if need > self.high:
            raise BudgetError(f"{what} can never fit: the high watermark is {self.high} bytes "
                              f"(device budget {self.config.device_budget})")
        pinned = self.pinned_bytes()
        if pinned + need > self.high:
            raise BudgetError(f"{what} cannot fit: {pinned} bytes are pinned and the high "
                              f"watermark is {self.high} bytes (pins held by forwards, daemon.use, "
                              f"pin() and control-plane leases: `prefetchd ctl list`, status()['pinned'])")
        return need

    # ------------------------------------------------------------------ reservations
    def reserve(self, nbytes, *, demand, incoming=None):
        """A device block for nbytes, None to wait, or BudgetError if it can never fit."""
        be = self.backend
        need = self.check_fits(nbytes, incoming.name if incoming is not None else None)
        if be.device_used() + need > self.high and not self.make_room(need, demand=demand,
                                                                      incoming=incoming):
            return None
        # Where the framework tensor still points (if anywhere): landing there again
        # saves a rebind, which in MindSpore waits for the whole op queue to drain.
        prefer = incoming.bound_address if incoming is not None and incoming.home is None \
            and incoming.bound_address else None
        while True:
            try:
                block = be.alloc_device(nbytes, prefer)
                break
            except _native.OutOfSpace:
                # Enough bytes under the watermark but no contiguous run:
                # evict one more victim by policy and try again.
                if not self.evict_one(demand, incoming):
                    return None
        used = be.device_used()
        for check in self.reserve_checks:
            check(used, self.high)
        assert used <= self.high, (used, self.high)
        self.peak = max(self.peak, used)
        return block

    def release(self, block, exposed, epoch, rec):
        """Give the block of rec's dropped replica back: now, or after compute that read
        it. With a home, its pages leave the home first (which then faults on reads)."""
        if exposed:
            self.unfenced.append((block, epoch, rec))
        else:
            self._free(block, rec)

    def reclaim(self, rec):
        """Give `rec` back the block whose pages still sit at its home waiting for a compute
        fence; True if there was one. Compute may still read it, so it stays exposed with
        that fence's epoch: its next drop waits for the same fence again."""
        for i, (block, epoch, dropped) in enumerate(self.unfenced):
            if dropped.home is rec.home:
                del self.unfenced[i]
                rec.block, rec.compute_epoch, rec.exposed = block, epoch, True
                return True
        return False

    def _free(self, block, rec):
        home = rec.home
        if home is not None:
            # The last look, with compute finished: a write since the drop keeps the block.
            if rec.state is State.ABSENT and self.backend.written(home):
                self.written_late(rec, block)
                return
            lending.release_home(self.backend, self.stats, rec, block)   # lent, parked or detached
        self.backend.free_device(block)

    # ------------------------------------------------------------------ victims
    def victims(self, demand, incoming):
        """Eviction candidates, best victim first."""
        candidates = [r for r in self.registry
                      if r.state is State.RESIDENT and not r.pins and not r.waiters
                      and not r.writeback_failed and (demand or not r.prefetched_unused)]
        if incoming is not None and not demand and self.policy.knows(incoming.name):
            # Belady: never evict a tensor needed sooner than the one being prefetched.
            return self.policy.rank_beyond(candidates, self.policy.distance(incoming.name))
        return self.policy.rank(candidates)

    def make_room(self, need, *, demand, incoming=None):
        """Evict until used + need <= low watermark (hysteresis). True if room now exists."""
        be = self.backend
        needed = self.high - need
        goal = min(self.low, needed)
        self.fence_if(lambda: be.device_used() + need > self.high)
        if be.device_used() <= goal:
            return True
        # Blocks already released wait only for a compute fence: count them as free.
        projected = be.device_used() - sum(entry[0].capacity for entry in self.unfenced)
        # (ranking the candidates is most of a reservation's cost: not when those cover it)
        for victim in self.victims(demand, incoming) if projected > goal else ():
            if incoming is not None and victim.prefetched_unused and projected <= needed:
                # Only a demand load ranks these, and only for the room it needs: the
                # hysteresis below that would undo a prefetch, at a tight budget the next
                # unit's. (A lowered watermark, no incoming, goes down to its low all the same.)
                continue
            projected -= be.block_bytes(victim.nbytes)
            self.evict(victim, "watermark")
            if projected <= goal:
                break
        self.fence_if(lambda: True)
        return be.device_used() + need <= self.high

    def evict_one(self, demand, incoming):
        """Free one victim's block now (True), or start its write-back / find none (False)."""
        for victim in self.victims(demand, incoming):
            self.evict(victim, "watermark")
            self.fence_if(lambda: True)
            return victim.state is State.ABSENT
        self.fence_if(lambda: True)
        return False

    # ------------------------------------------------------------------ fences
    def fence_if(self, condition):
        """Free released device blocks once compute that read them has finished.

        MindSpore runs ops asynchronously even on CPU. A block whose last
        reader was a hooked unit carries that unit's compute-fence epoch: it is
        free as soon as the fence word reaches it. If memory is needed
        (`condition()`) and the epoch is not there yet, the scheduler does not
        block: the fence kernel wakes its wait for completions when it is
        (backend.wake_at_fence), and the reservation waits meanwhile. Blocks
        with no epoch need a whole-queue fence, taken with
        the lock released so the compute thread keeps submitting (only the
        scheduler thread changes residency, so the blocks taken are exactly
        the ones the fence covers).
        """
        if not self.unfenced:
            return
        marker = self.backend.marker
        if marker is not None:
            pending = []
            for entry in self.unfenced:
                block, epoch, rec = entry
                if epoch is not None and marker.reached(epoch):
                    self._free(block, rec)
                else:
                    pending.append(entry)
            self.unfenced = pending
        if not self.unfenced or not condition():
            return
        epochs = [entry[1] for entry in self.unfenced]
        if marker is not None and None not in epochs:
            if self.backend.wake_at_fence(max(epochs)):
                self.stats.fences += 1   # memory reuse now waits on compute (without blocking)
            return
        entries, self.unfenced = self.unfenced, []
        self._lock.release()
        try:
            self.backend.compute_fence()
        except BaseException:
            # Compute may still read these blocks, and their pages still sit at
            # the homes: keep them waiting, so a later fence frees them and a
            # load of the same tensor can reclaim its block.
            self._lock.acquire()
            self.unfenced = entries + self.unfenced
            raise
        else:
            self._lock.acquire()
        self.stats.fences += 1
        for block, _epoch, rec in entries:
            self._free(block, rec)

    def close(self):
        self.unfenced.clear()
