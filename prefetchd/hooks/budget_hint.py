"""The budget hint: the smallest device_budget under which a model's units would fit.

A plan refused at offload() (prefetchd.hooks.planner.Plan.check_fits) ends its
BudgetError with that budget, at the plan's lookahead and at 0. It is found by
bisection over the planner itself, so page/granule rounding, splits, the root
and the unit share are all included: this module gets the re-planning as a
function (`fits(high)`, or `min_high(lookahead)`) and never imports the planner.
The Plan's min_high_watermark, min_device_budget and budget_hint call it.
"""
from ..config import BOUNDS
from ..errors import PrefetchdError

# What Config.__post_init__ makes the high watermark when high_watermark is not set:
# int(device_budget * 0.95) (tests/hooks/test_planner_refusals.py checks the two agree).
DEFAULT_HIGH_FRACTION = 0.95


def lowest_fitting(fits, start):
    """The smallest high watermark (bytes) with fits(high) true, by bisection; `start`: a high
    watermark expected to fit (doubled until one does), None if none does below 2**60.
    fits(result) holds and fits(result - 1) does not."""
    lo, hi = 0, start
    while not fits(hi):                  # everything at once always fits; guard anyway
        lo, hi = hi, hi * 2
        if hi > 1 << 60:
            return None
    if fits(lo):
        return lo
    while hi - lo > 1:                   # fits(hi), not fits(lo)
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi


MIN_BUDGET = BOUNDS["device_budget"][0]      # the smallest device_budget a Config takes


def budget_for_high_watermark(high, fraction=DEFAULT_HIGH_FRACTION):
    """The smallest device_budget B with int(B * fraction) >= high (the Config's rounding),
    at least the smallest a Config takes."""
    budget = max(int(-(-high // fraction)), MIN_BUDGET)
    while int(budget * fraction) < high:
        budget += 1
    while budget > MIN_BUDGET and int((budget - 1) * fraction) >= high:
        budget -= 1
    return budget


def hint_text(min_high, lookahead, fraction, resident=None):
    """'; ... device_budget >= ... at lookahead k (lookahead 0: ...)', or '' (no replan).
    min_high: fn(lookahead) -> the smallest high watermark that fits, or None; fraction:
    the high watermark / device_budget the suggested budget assumes; resident: the bytes of
    the whole model on the device. A budget is never named above it: where the default
    fraction would, the hint names `resident` with the high watermark set explicitly."""
    try:
        need = min_high(lookahead)
    except PrefetchdError:
        return ""
    if need is None:
        return ""
    text = (f"; the smallest budget under which it plans units that fit: device_budget >= "
            f"{_budget_text(need, fraction, resident)} at lookahead {lookahead}")
    if lookahead > 0:
        # Lookahead changes only the unit share, so how finely blocks split: a larger one
        # may need less (smaller units), not only more.
        need0 = min_high(0)
        text += (f" (lookahead 0: {_budget_text(need0, fraction, resident)})"
                 if need0 != need else " (the same at lookahead 0)")
    if "the whole model" in text:
        return text + (f" (the default high watermark, {fraction:.0%} of device_budget, would name a budget "
                       f"above the model's own size)")
    return text + (f", with the high watermark at {fraction:.0%} of device_budget (the default; "
                   f"a high watermark of at least {need} bytes)")


def _budget_text(need, fraction, resident):
    budget = budget_for_high_watermark(need, fraction)
    if resident is not None and need <= resident < budget:
        return f"{_size_text(resident)}, the whole model, with high_watermark >= {need} bytes"
    return _size_text(budget)


def _size_text(nbytes):
    """'1536MiB (1610612736 bytes)': a size the Config reads, rounded up, and the exact bytes.
    The unit is the largest whose rounding adds at most 1% (1.01 MiB is 1035KiB, not 2MiB:
    a size copied from the hint should not nearly double the budget)."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        rounded = -(-nbytes // scale)
        if nbytes >= scale and rounded * scale - nbytes <= nbytes // 100:
            gib = f", {-(-nbytes * 100 // (1 << 30)) / 100:.2f} GiB" if nbytes >= 1 << 30 else ""
            return f"{rounded}{unit} ({nbytes} bytes{gib})"
    return f"{nbytes} bytes"
