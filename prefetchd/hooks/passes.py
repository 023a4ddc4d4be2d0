"""The two kinds of pass an offloaded model runs, called by the Offloaded handle's hooks.

RecordingPass, the first pass that runs a unit: records the execution order (the trace),
fetches every unit on demand, and runs one unit at a time so the cost model can time each
unit's compute with no copy beside it. StreamingPass, every pass after it: follows the
trace, prefetching `lookahead` units ahead of the one computing; a unit that was not
resident in time is a miss (fetched on demand, or NotResidentError with strict=True).

Both take the same calls, in this order within a pass:
    begin()            the model's pre-hook, before the root is pinned
    acquire(unit)      pin a unit (the root, then each unit as it is entered)
    after_root()       the root is pinned
    enter(unit)        a unit's first cell (or part) is about to run: step the trace, pin it
    timed(unit, out)   its last cell ran: time its compute now (recording) or leave it
    after_release()    a unit was released: its memory may admit a prefetch now
    finish()           the model's post-hook ran the pass to its end
    abandoned()        the forward ended (after finish(), a no-op), or it raised / ran no
                       unit: a streamed pass cut short may change the trace (True)
"""
import logging

from .trace_cursor import ROOT

log = logging.getLogger("prefetchd.hooks")

# How far past the lookahead the prefetch window looks for byte-moving loads, in units of
# the trace: past it a disk read waits for the window to come closer. Every unit scanned is
# a check of its records on the compute thread, twice per unit run (~1 us a record).
WINDOW_SCAN_PAST = 4


class RecordingPass:
    recording = True

    def __init__(self, cursor, session, pins, estimator, tier_of):
        self._cursor, self._session, self._pins = cursor, session, pins
        self._estimator, self._tier_of = estimator, tier_of

    def begin(self):
        self._cursor.start_recording()

    def acquire(self, unit):
        self._pins.acquire(unit, auto_fetch=True)

    def after_root(self):
        self._estimator.recording_started(self._session.marker, self._pins.stall_seconds)

    def enter(self, unit):
        self._cursor.record(unit.index)
        self.acquire(unit)

    def timed(self, unit, output):
        # Timed to a fence before the view check asks for addresses. That query drains
        # MindSpore's op queue, and a fence after it times the unit's kernels launched from
        # an idle queue: twice their time in a pass (16 Dense(4096, 4096) at batch 8).
        return bool(unit.records) and self._estimator.time_unit(self._session.marker, unit.name, output,
                                                                unit.dispatched_ns)

    def after_release(self):
        pass

    def finish(self, high_watermark):
        """The trace is recorded: the cost model gets the pass's timings."""
        pins = self._pins
        units = [pins.units[i] for i in self._cursor.steps if i != ROOT]
        self._estimator.recorded(units, pins.root.nbytes, self._tier_of(), pins.stall_seconds, high_watermark)

    def abandoned(self):
        self._estimator.recording_abandoned()
        return False


class StreamingPass:
    recording = False

    def __init__(self, cursor, session, pins, estimator, lookahead_of, high_of, *, auto_fetch, publish):
        self._cursor, self._session, self._pins = cursor, session, pins
        self._estimator = estimator
        self._publish = publish        # fn(): the cursor's steps changed, the policy gets them
        self._lookahead_of, self._high_of = lookahead_of, high_of
        self._auto_fetch = auto_fetch

    def begin(self):
        self._session.at(0)

    def acquire(self, unit):
        pins = self._pins
        # lookahead 0 loads every unit on demand by design: not a miss to warn about, nor
        # one for strict=True to raise (every pass would, also where "auto" picked 0)
        auto = self._auto_fetch or self._lookahead_of() == 0
        # the prefetches behind a missed unit were issued before the miss: issue them again
        # (the unit is held by then, so held_bytes() counts it)
        pins.acquire(unit, auto_fetch=auto, after_miss=lambda: self.prefetch_from(
            self._cursor.position + 1, pins.held_bytes()))

    def after_root(self):
        self.prefetch_from(1, self._pins.root.nbytes)

    def enter(self, unit):
        if not self._cursor.enter(unit.index):
            self._session.resynced()
        elif self._cursor.switched:        # a pass of another kind: its order is the trace
            self._publish()
        self._session.at(self._cursor.position)
        self.prefetch_from(self._cursor.position + 1, self._pins.held_bytes() + unit.nbytes)
        self.acquire(unit)

    def timed(self, unit, output):
        return False

    def after_release(self):
        # Its memory is free once its kernels ran: a prefetch refused a moment ago for
        # want of a free range can be placed now, before it would miss.
        self.prefetch_from(self._cursor.position + 1, self._pins.held_bytes())

    def finish(self, high_watermark):
        """True when the trace changed: the pass ran units it lacked (its order is the trace
        now), or passes like it are followed by another kind (TraceCursor.end_pass)."""
        self._estimator.streamed()
        return self._cursor.end_pass()

    def abandoned(self):
        """The pass raised part-way: True if its order is the trace now (TraceCursor.abandon_pass)."""
        return self._cursor.abandon_pass()

    def prepare_next(self):
        """The next pass starts with the root, then the first units of the trace: the policy
        sees the pass end (the root is the nearest step, not the farthest). Returns the root's
        prefetch future (None without root records)."""
        root = self._pins.root
        self._session.at(len(self._cursor.steps) - 1)
        future = self._session.prefetch(root.records, priority=self._lookahead_of() + 1) \
            if root.records else None
        self.prefetch_from(1, root.nbytes)
        return future

    def prefetch_from(self, start, pinned_bytes):
        """Prefetch ahead of compute, within the room beside the pinned units: the next unit,
        then the next `lookahead` units whose loads move bytes (disk reads, copies), looking
        past units that load by a page move, then the page-move units among the next
        `lookahead`. A page move needs no lead time and a disk read does: where the host
        cache keeps every other unit (core/spread.py), giving the reads the room first
        queues the next one while the current one runs, so the disk does not wait for
        compute to reach it."""
        lookahead = self._lookahead_of()
        if lookahead == 0:
            return
        first, near = self._window(start, lookahead)
        # Never ask for more than fits beside what computes now: a prefetch that
        # evicts the next unit to make room for the one after is thrash.
        room = self._high_of() - pinned_bytes
        for ahead, unit in first + near:
            if unit.held:
                continue
            room -= unit.nbytes
            if room < 0:
                break
            # Nearer units first: priority falls with distance.
            future = self._session.prefetch(unit.records, priority=lookahead - ahead + 1)
            # A refused prefetch (e.g. no free range large enough) shows up as a miss later.
            future.add_done_callback(lambda f, name=unit.name: f.exception() is not None and log.debug(
                "prefetch of %s failed: %s", name, f.exception()))

    def _window(self, start, lookahead):
        """([(distance, unit)] to place first: the next unit and the byte-moving ones, in
        trace order; [(distance, unit)] of the page-move units within `lookahead` after it)."""
        scan = 2 * lookahead + WINDOW_SCAN_PAST
        units = [self._pins.units[index] for index, _ in zip(self._cursor.upcoming(start), range(scan))]
        first, near, moving = [], [], 0
        for ahead, (unit, moves) in enumerate(zip(units, self._session.moves_bytes(
                [u.records for u in units])), 1):
            moving += moves
            if ahead == 1 or moves:
                first.append((ahead, unit))
            elif ahead <= lookahead:
                near.append((ahead, unit))
            if moving >= lookahead and ahead >= lookahead:
                break
        return first, near
