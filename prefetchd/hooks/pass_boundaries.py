"""Where a pass of an offloaded model begins and ends: the model's own hooks.

A mixin of prefetchd.hooks.handle.Offloaded, kept apart so that class reads one screen at
a time. A pass begins at the model's pre-hook (or an outer cell's call, outer_calls.py):
it takes the model's pass turn, pins the root and prefetches. It finishes at the post-hook
(the output's copies made, pins released behind its fence, the trace published and the
next pass's start prefetched), and ends in the hook MindSpore calls after every forward,
also one that raised: that one releases what a forward cut short left pinned.
"""
import contextlib
import logging

from ..errors import PrefetchdError, ShutdownError
from . import refusals
from .units import first_tensor

log = logging.getLogger("prefetchd.hooks")


class PassBoundaries:
    @contextlib.contextmanager
    def between_passes(self):
        """Hold this model's forwards off (callers on other threads wait) while the block runs;
        refused inside one of its forwards, whose pins and prefetches it would cut across."""
        with self.turn.held():
            yield
            # The block may have evicted the next pass's start, or be writing it back on its
            # way out (a prefetch then keeps it: core/loads.py want_resident).
            root = self._prefetch_next_pass()
            if root is not None:
                root.exception()           # a refused prefetch shows up as the pass's miss

    # ---------------------------------------------------------------- the model's hooks
    def _before_model(self, cell, inputs):
        self._begin_pass(cell)

    def _begin_pass(self, opener):
        """Open a pass for `opener`'s call: the model's, or an outer cell's (outer_calls.py)."""
        if self.daemon.forked:
            # Before any lock: one another thread of the parent held at the fork (its daemon's,
            # this model's pass turn) stays held in the child, and the forward waited for good.
            self.daemon.check_open()
        self._compiled_later.refuse_compiled_holders()
        self.turn.take(opener=opener)        # (the same thread: a nested call runs through)
        if self.closed or self.half_loaded:  # closed, or a load failed, while this forward waited
            self.turn.give()
            raise refusals.closed_refused(self.model, self.daemon.config.name) if self.closed \
                else PrefetchdError(self.half_loaded)
        self._pins.release_all(None)          # a pass that raised midway left pins behind
        self._compiled_later.drop_probes_under_compiled()
        for unit in self.units:
            unit.part_depth = unit.running = 0    # (a pass that raised left them counting)
        self._high = self._session.high_watermark
        self._ran = 0
        self._cursor.start_pass()
        self._pass.begin()
        # The root is pinned before the first prefetches: at step 0 its next use after
        # this one looks a whole pass away, so a prefetch queued ahead of its pin could
        # evict it (a miss at every such pass start, seen under load).
        self._pass.acquire(self.root)
        self._pass.after_root()

    def _after_model(self, cell, inputs, output):
        return self._finish_pass(cell, output)

    def _finish_pass(self, cell, output):
        """Close the pass `cell`'s call opened; the output its caller gets."""
        recording = self._pass.recording
        output = self._views.copied(self.root, cell, output, recording)
        self._pins.release_all(first_tensor(output))
        self._replaced.check()            # a Parameter the pass replaced: said once
        if recording and self._ran == 0 and self.units:
            # A pass that ran none of the units (embeddings only, every block skipped) read
            # none of their weights and has no order to record: the next pass records it.
            # (A compiled model, whose hooks never fire, is all root: it has no units.)
            return output
        retraces = self._cursor.retraces
        retraced = self._pass.finish(self._high)
        if recording:
            self._pass = self._streaming
            self._adopt_entries()
        if recording or retraced:
            self._publish_trace()
        if self._cursor.retraces == 1 > retraces:
            log.info("prefetchd.offload: a pass ran units the trace did not hold (a changed route "
                     "or branch); its order is the trace now (counted in stats()['retraces'])")
        self._streaming.prepare_next()
        return output

    def _end_pass(self, cell=None, inputs=None, output=None):
        if self.turn.held_here():
            try:   # a forward that raised still pins its units: another model may need the room
                self._pins.release_all(None)
                self._abandon_pass()
            finally:
                self.turn.give()

    def _abandon_pass(self):
        """A recording pass cut short records again; a streamed one may be the trace now, and
        prefetches the next pass's start as a finished one did (_end_pass runs after every
        forward: after one that finished, there is nothing to do)."""
        cut_short = self._cursor.open
        if self._pass.abandoned():
            self._publish_trace()
        if cut_short:
            self._prefetch_next_pass()

    def _prefetch_next_pass(self):
        """The next pass's start (the root, the first units), as a finished pass leaves it
        prefetched; the root's prefetch future, if any. After a pass that raised it was
        not: under strict=True a raise at the root (a reload had evicted it) raised at
        every later pass's root."""
        if self._pass is not self._streaming or self.closed:
            return None
        try:
            return self._streaming.prepare_next()
        except ShutdownError:         # the daemon closed: no next pass (a forward is refused)
            return None
