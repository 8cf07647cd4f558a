"""BreakpointPolicy: cache_control breakpoints -> exact retention ranges and usage counts."""

from __future__ import annotations

import pytest

from kvreuse.api.cache_breakpoints import (
    Breakpoint,
    BreakpointPolicy,
    CachePlan,
    CacheUsage,
    Segment,
    check_breakpoints,
)
from kvreuse.cache.retention import TokenRangeRetentionConfig as R

FIVE, HOUR = 300_000, 3_600_000

SEGMENTS = [
    Segment(frozenset({"tools", "system"}), 0, 40),
    Segment(frozenset({"document"}), 40, 90),
    Segment(frozenset({"history"}), 90, 120),
    Segment(frozenset({"history"}), 120, 150),
    Segment(frozenset({"history"}), 150, 170),
]


def test_each_breakpoint_closes_the_segments_since_the_previous_one():
    plan = BreakpointPolicy().plan(
        SEGMENTS,
        [Breakpoint(0, "1h", "system[0].cache_control"), Breakpoint(2, "5m", "messages[1].content[0].cache_control")],
    )
    assert plan.ranges == (R(0, 40, 95, HOUR), R(40, 90, 50, FIVE), R(90, 120, 40, FIVE))
    assert plan.ttls == ("1h", "5m", "5m")
    assert plan.tokens_by_class() == [("tools", "1h", 40), ("document", "5m", 50), ("history", "5m", 30)]
    assert plan.retention().token_range_retention_configs == plan.ranges


def test_system_alone_and_a_server_policy():
    segments = [Segment(frozenset({"system"}), 0, 30), Segment(frozenset({"history"}), 30, 60)]
    policy = BreakpointPolicy(
        priorities={"tools": 100, "system": 88, "document": 60, "history": 21}, durations_ms={"5m": 1000, "1h": 2000}
    )
    plan = policy.plan(segments, [Breakpoint(1, "5m", "cache_control")])
    assert plan.ranges == (R(0, 30, 88, 1000), R(30, 60, 21, 1000))


def test_no_breakpoint_no_retention_and_empty_segments_skipped():
    assert BreakpointPolicy().plan(SEGMENTS, []).retention() is None
    segments = [Segment(frozenset({"system"}), 0, 0), Segment(frozenset({"history"}), 0, 20)]
    plan = BreakpointPolicy().plan(segments, [Breakpoint(1, "5m", "x"), Breakpoint(1, "5m", "y")])
    assert plan.ranges == (R(0, 20, 40, FIVE),)


def test_usage_first_request_writes_full_blocks_up_to_the_last_breakpoint():
    plan = BreakpointPolicy().plan(SEGMENTS, [Breakpoint(0, "1h", "a"), Breakpoint(2, "5m", "b")])
    # last breakpoint ends at 120; block 16: stored up to 112
    assert plan.usage(170, 0, 16) == CacheUsage(170 - 112, 0, 112, 112 - 40, 40)
    # the repeat: 160 tokens (10 full blocks) come from the cache, nothing is written
    assert plan.usage(170, 160, 16) == CacheUsage(10, 160, 0, 0, 0)
    # a prefix of 48 cached: 48..112 written now, all in 5m ranges
    assert plan.usage(170, 48, 16) == CacheUsage(170 - 48 - 64, 48, 64, 64, 0)


def test_usage_without_breakpoints_is_read_and_input():
    assert CachePlan().usage(100, 32, 16) == CacheUsage(68, 32, 0, 0, 0)


def test_check_breakpoints_rules():
    check_breakpoints([Breakpoint(0, "1h", "tools[0].cache_control"), Breakpoint(1, "5m", "system[0].cache_control")])
    five = [Breakpoint(i, "5m", f"messages[{i}].content[0].cache_control") for i in range(5)]
    with pytest.raises(ValueError, match=r"^messages\[4\]\.content\[0\]\.cache_control: a request may have at most 4"):
        check_breakpoints(five)
    with pytest.raises(ValueError, match=r"^system\[0\]\.cache_control\.ttl: a 1h cache_control may not follow"):
        check_breakpoints(
            [Breakpoint(0, "5m", "tools[0].cache_control"), Breakpoint(1, "1h", "system[0].cache_control")]
        )
    with pytest.raises(ValueError, match=r"^cache_control\.ttl: must be one of 5m, 1h, got '2h'"):
        check_breakpoints([Breakpoint(0, "2h", "cache_control")])


def test_policy_refuses_bad_configuration():
    with pytest.raises(ValueError, match="priorities: give exactly"):
        BreakpointPolicy(priorities={"tools": 90})
    with pytest.raises(ValueError, match="history must be an integer in"):
        BreakpointPolicy(priorities={"tools": 90, "system": 80, "document": 50, "history": 101})
    with pytest.raises(ValueError, match="durations"):
        BreakpointPolicy(durations_ms={"5m": 0, "1h": 1})


def test_openai_prompt_cache_retention():
    from kvreuse.api.cache_breakpoints import prompt_cache_retention_config

    assert prompt_cache_retention_config(None) is None and prompt_cache_retention_config("in_memory") is None
    assert prompt_cache_retention_config("24h") == {
        "token_range_retention_configs": [
            {"token_start": 0, "token_end": None, "priority": 40, "duration_ms": 86_400_000}
        ]
    }
    with pytest.raises(ValueError, match="^prompt_cache_retention: must be one of in_memory, 24h, got '1h'"):
        prompt_cache_retention_config("1h")


def test_policy_from_the_server_flags():
    policy = BreakpointPolicy.parse("system=88, history=21", "1h=7200")
    assert dict(policy.priorities) == {"tools": 95, "system": 88, "document": 50, "history": 21}
    assert dict(policy.durations_ms) == {"5m": 300_000, "1h": 7_200_000}
    assert BreakpointPolicy.parse() == BreakpointPolicy()
    with pytest.raises(ValueError, match=r"^--cache-control-priorities takes name=integer pairs .*'rag=50'"):
        BreakpointPolicy.parse("rag=50")
    with pytest.raises(ValueError, match=r"^--cache-control-ttls takes name=integer pairs .*'1h=x'"):
        BreakpointPolicy.parse(None, "1h=x")
    with pytest.raises(ValueError, match="tools must be an integer in"):
        BreakpointPolicy.parse("tools=101")
