"""Per-model histograms the front keeps for its metrics (batch size, queue time):
cumulative counts per upper bound, as Prometheus histograms report them. Written
on the front's I/O thread; snapshot() copies, for the exporter's thread."""
import bisect
import math

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QUEUE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0)


class Histogram:
    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)     # the last is +Inf
        self.sum = 0.0

    def observe(self, value):
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self):
        """{"buckets": [(upper bound, cumulative count)...], "sum", "count"}."""
        counts = list(self.counts)
        cumulative, total = [], 0
        for bound, n in zip(self.bounds + (math.inf,), counts):
            total += n
            cumulative.append((bound, total))
        return {"buckets": cumulative, "sum": self.sum, "count": total}
