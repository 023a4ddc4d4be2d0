"""Eviction order (prefetchd/core/policy.py): `rank_beyond` is `rank` with the
candidates needed within `limit` steps left out, for every policy and trace state."""
import random

import pytest

from prefetchd.core import policy as policies


class _Rec:
    def __init__(self, name, last_use):
        self.name, self.last_use = name, last_use


@pytest.mark.parametrize("name", sorted(policies.POLICIES))
@pytest.mark.parametrize("seed", range(20))
def test_rank_beyond_is_rank_without_the_nearer_candidates(name, seed):
    rng = random.Random(seed)
    policy = policies.create(name)
    names = [f"t{i}" for i in range(rng.randrange(1, 30))]
    if rng.random() < 0.8:                          # some runs before any trace
        for owner in range(rng.randrange(1, 3)):
            steps = [rng.sample(names, rng.randrange(1, 4)) for _ in range(rng.randrange(1, 12))]
            policy.set_trace(steps, owner=owner)
            policy.advance(rng.randrange(len(steps)), owner=owner)
    candidates = [_Rec(n, rng.randrange(5)) for n in rng.sample(names, rng.randrange(len(names) + 1))]
    candidates.append(_Rec("untraced", 0))
    for limit in (-1, 0, 1, 3, 7, float("inf")):
        want = [r for r in policy.rank(candidates) if policy.distance(r.name) > limit]
        assert policy.rank_beyond(candidates, limit) == want
