"""Where a recorded trace goes: the core's eviction policy and, where the backend loads
through a machine's shared host tier (prefetchd.sharedhost), that tier's owner, which
ranks its blocks by Belady's rule on every attached process' trace."""


def set_trace(core, steps, owner):
    """owner's recorded order (one collection of tensor names per step). Caller holds core.lock."""
    core.policy.set_trace(steps, owner)
    shared = getattr(core.backend, "shared", None)
    if shared is not None:
        shared.set_trace(steps)     # queued for the tier's load thread: no wait on the owner here
