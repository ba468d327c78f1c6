"""When the arbiter asks Serve's proxies to give back a drained backlog's memory (policies/memory_return.py)."""

from __future__ import annotations

import pytest

from baige_ray.policies.memory_return import MemoryReturnPolicy, should_return_memory

POLICY = MemoryReturnPolicy(min_backlog=32, idle_depth=2, min_interval_s=10.0)


@pytest.mark.parametrize("peak, depth, since, expected", [
    (64, 0, 30.0, True),     # a backlog, drained, long enough after the last return
    (64, 2, 30.0, True),     # as drained as idle_depth allows
    (64, 3, 30.0, False),    # still draining: the pages would be taken again
    (31, 0, 30.0, False),    # never a backlog: nothing to return
    (64, 0, 9.9, False),     # too soon after the last return
])
def test_returns_only_after_a_drained_backlog(peak, depth, since, expected):
    assert should_return_memory(peak, depth, since, POLICY) is expected


def test_policy_is_validated():
    with pytest.raises(ValueError, match="min_backlog"):
        MemoryReturnPolicy(min_backlog=0)
    with pytest.raises(ValueError, match="idle_depth=40"):
        MemoryReturnPolicy(min_backlog=32, idle_depth=40)
    with pytest.raises(ValueError, match="min_interval_s"):
        MemoryReturnPolicy(min_interval_s=-1)
