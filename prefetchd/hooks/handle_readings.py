"""What an offloaded model's handle tells its user: the plan, the trace, and per-pass counts.

A mixin of prefetchd.hooks.handle.Offloaded, kept apart so that class reads one screen
at a time; it reads the handle's estimator, plan, trace cursor and pins.
"""


class HandleReadings:
    @property
    def lookahead(self):
        """Units prefetched ahead: the one asked for, or with "auto" the cost model's."""
        return self._estimator.lookahead

    @property
    def estimate(self):
        """The cost model's plan (prefetchd.cost.model.Schedule: pass_seconds, ...) once the recording pass
        ran, refined by the next passes; None without one."""
        return self._estimator.estimate

    def plan(self):
        """The unit plan (prefetchd.hooks.planner.Plan): units, root unit, budget figures."""
        return self._plan

    @property
    def trace(self):
        """The recorded order of one pass: ROOT, then unit indices (prefetchd.hooks.trace_cursor)."""
        return self._cursor.steps

    @property
    def resyncs(self):
        return self._cursor.resyncs

    @property
    def misses(self):
        return self._pins.misses

    @property
    def stall_seconds(self):
        return self._pins.stall_seconds

    def stats(self):
        """units: planned units (root excluded); trace: steps of one pass (root included);
        misses: units not resident in time (fetched on demand, or raised with strict=True);
        resyncs: units that were not the trace's next step; retraces: passes that ran a unit
        the trace lacked, whose order became the trace."""
        return {"units": len(self.units), "trace": len(self.trace), "resyncs": self.resyncs,
                "retraces": self._cursor.retraces,
                "stall_seconds": self.stall_seconds, "misses": self.misses,
                "root_bytes": self.root.nbytes, "lookahead": self.lookahead,
                "predicted_pass_seconds": self.estimate.pass_seconds if self.estimate else None}
