"""The cost model: how far ahead to prefetch, what the host cache keeps, how long a pass takes.

Pure Python and no MindSpore at import (the recording pass imports the framework lazily).

    model        the pipeline simulation: Inputs -> Schedule (lookahead, host-cached units, times)
    estimate     a model's predicted pass time, kept current over its first passes
    recording    timing the recording pass, one unit at a time
    refine       refining the rates and compute with later passes
    fence_clock  the thread that notes when compute reaches each unit's release fence
"""
