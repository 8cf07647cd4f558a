"""TensorRT-LLM retention: per-block priorities, validation, and the pool's retention rules
(expiry at release + duration, reuse overwrite, lowest priority first, leaves only), with
exact block ids and eviction order and ``check_integrity`` after every step; and retention typed
from the edge to the sequence."""

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.cache.block_pool import DEFAULT_PRIORITY, BlockPool
from kvreuse.cache.eviction import PriorityPolicy
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.cache.retention import (
    KvCacheRetentionConfig,
    TokenRangeRetentionConfig,
    as_retention,
    block_priorities,
    checked_retention,
    decode_duration_ms,
    decode_retention_priority,
    ranges_from_message_boundaries,
    requested_block_retention,
    requested_retention,
)
from kvreuse.events.records import BlockUpdated

T = TokenRangeRetentionConfig
C = KvCacheRetentionConfig


# ---------------------------------------------------------------------- block priorities
def test_trtllm_case_ranges_split_inside_a_block():
    config = C((T(0, 63, 80), T(63, 127, 30)))
    assert [p for p, _ in block_priorities(config, 128, 32)] == [80, 80, 30, 30]


def test_trtllm_case_first_token_decides():
    config = C((T(0, 1, 80), T(1, 2, 5)))
    assert [p for p, _ in block_priorities(config, 128, 32)] == [80, 35, 35, 35]


def test_trtllm_case_range_not_at_block_start():
    config = C((T(127, 193, 80),))
    assert [p for p, _ in block_priorities(config, 256, 64)] == [35, 35, 80, 80]


def test_open_range_durations_and_decode_blocks():
    config = C((T(0, 32, 90, 30000), T(32, None, 50)), decode_retention_priority=10, decode_duration_ms=5000)
    # 100 prompt tokens + 60 generated, blocks of 32: first tokens 0, 32, 64, 96 (prompt), 128 (generated)
    assert block_priorities(config, 160, 32, num_prompt_tokens=100) == [
        (90, 30.0),
        (50, None),
        (50, None),
        (50, None),
        (10, 5.0),
    ]
    assert decode_retention_priority(config) == 10 and decode_duration_ms(config) == 5000
    assert decode_retention_priority(None) == DEFAULT_PRIORITY and decode_duration_ms(None) is None
    assert block_priorities(None, 33, 32) == [(35, None), (35, None)]


def test_requested_retention_leaves_unranged_blocks_unset():
    config = C((T(32, 64, 80, 1000),))
    assert requested_retention(config, 96, 32) == [(None, None), (80, 1.0), (None, None)]
    assert requested_retention(None, 64, 32) == [(None, None), (None, None)]


@pytest.mark.parametrize(
    "config",
    [
        None,
        C((T(32, 64, 80, 1000),)),
        C((T(0, 63, 80), T(63, 127, 30))),
        C((T(0, 32, 90, 30000), T(32, None, 50)), decode_retention_priority=10, decode_duration_ms=5000),
        C((T(5, 9, 70), T(40, 41, 20), T(100, None, 60, 7))),
    ],
)
def test_per_block_lookup_equals_the_whole_list(config):
    """``requested_block_retention`` is one entry of ``requested_retention``, for every
    block, prompt length and block size."""
    for bs in (1, 4, 32):
        for prompt in (0, 1, 33, 100, 160):
            wanted = requested_retention(config, 160, bs, num_prompt_tokens=prompt)
            got = [requested_block_retention(config, first, num_prompt_tokens=prompt) for first in range(0, 160, bs)]
            assert got == wanted


# ---------------------------------------------------------------------- validation
def test_from_dict_accepts_the_spec_example():
    config = C.from_dict(
        {
            "token_range_retention_configs": [
                {"token_start": 0, "token_end": 1000, "priority": 100, "duration_ms": 30000},
                {"token_start": 1000, "token_end": None, "priority": 50, "duration_ms": 10000},
            ],
            "decode_retention_priority": 30,
            "decode_duration_ms": 5000,
        }
    )
    assert config == C((T(0, 1000, 100, 30000), T(1000, None, 50, 10000)), 30, 5000)


@pytest.mark.parametrize(
    "bad, path",
    [
        (
            {
                "token_range_retention_configs": [
                    {"token_start": 0, "token_end": 10, "priority": 1},
                    {"token_start": 5, "token_end": 20, "priority": 1},
                ]
            },
            "kv_cache_retention_config.token_range_retention_configs[1].token_start",
        ),
        (
            {
                "token_range_retention_configs": [
                    {"token_start": 0, "token_end": None, "priority": 1},
                    {"token_start": 5, "token_end": 20, "priority": 1},
                ]
            },
            "kv_cache_retention_config.token_range_retention_configs[0].token_end",
        ),
        (
            {"token_range_retention_configs": [{"token_start": -1, "token_end": 10, "priority": 1}]},
            "kv_cache_retention_config.token_range_retention_configs[0].token_start",
        ),
        (
            {"token_range_retention_configs": [{"token_start": 4, "token_end": 4, "priority": 1}]},
            "kv_cache_retention_config.token_range_retention_configs[0].token_end",
        ),
        (
            {"token_range_retention_configs": [{"token_start": 0, "token_end": 4, "priority": 101}]},
            "kv_cache_retention_config.token_range_retention_configs[0].priority",
        ),
        (
            {"token_range_retention_configs": [{"token_start": 0, "token_end": 4, "priority": True}]},
            "kv_cache_retention_config.token_range_retention_configs[0].priority",
        ),
        (
            {"token_range_retention_configs": [{"token_start": 0, "token_end": 4}]},
            "kv_cache_retention_config.token_range_retention_configs[0].priority",
        ),
        (
            {"token_range_retention_configs": [{"token_start": 0, "priority": 5, "duration_ms": -3}]},
            "kv_cache_retention_config.token_range_retention_configs[0].duration_ms",
        ),
        (
            {"token_range_retention_configs": [{"token_start": 0, "priority": 5, "colour": 1}]},
            "kv_cache_retention_config.token_range_retention_configs[0].colour",
        ),
        (
            {"token_range_retention_configs": {"token_start": 0}},
            "kv_cache_retention_config.token_range_retention_configs",
        ),
        ({"decode_retention_priority": -1}, "kv_cache_retention_config.decode_retention_priority"),
        ({"decode_duration_ms": "5s"}, "kv_cache_retention_config.decode_duration_ms"),
        ([1, 2], "kv_cache_retention_config"),
    ],
)
def test_from_dict_errors_name_the_field(bad, path):
    with pytest.raises(ValueError) as e:
        C.from_dict(bad)
    assert str(e.value).startswith(path + ":")


def test_message_boundaries_become_ranges():
    config = ranges_from_message_boundaries(
        [(0, 40), (40, 40), (40, 90), (90, 120)],
        [{"priority": 90, "duration_ms": 30000}, {"priority": 5}, None, {"priority": 60}],
    )
    assert config == C((T(0, 40, 90, 30000), T(90, 120, 60)))
    assert ranges_from_message_boundaries([(0, 10)], [None]) is None
    with pytest.raises(ValueError, match=r"^messages\[1\]\.retention\.priority:"):
        ranges_from_message_boundaries([(0, 10), (10, 20)], [None, {"priority": 300}])
    with pytest.raises(ValueError, match=r"^messages\[1\]\.token_start:"):
        ranges_from_message_boundaries([(0, 10), (5, 20)], [{"priority": 1}, {"priority": 2}])


# ---------------------------------------------------------------------- pool semantics
BS = 4


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(pool, tokens, config=None):
    """One request: hit, apply retention to hits, allocate, register with per-block retention.
    Returns the blocks (held) and the number of hit blocks."""
    hashes = hash_token_blocks(tokens, BS, model_id="m")
    chunks = [tokens[i : i + BS] for i in range(0, len(tokens), BS)]
    hits = pool.match_prefix(hashes, chunks)
    pool.acquire(hits)
    pool.check_integrity()
    wanted = requested_retention(config, len(tokens), BS)
    for block, (priority, duration) in zip(hits, wanted):
        pool.set_retention(block, priority, duration)
        pool.check_integrity()
    blocks = hits + pool.allocate(len(chunks) - len(hits))
    pool.check_integrity()
    for i, (priority, duration) in list(enumerate(block_priorities(config, len(tokens), BS)))[len(hits) : len(hashes)]:
        pool.register(
            blocks[i],
            hashes[i],
            hashes[i - 1] if i else None,
            chunks[i],
            depth=i,
            priority=priority,
            duration_s=duration,
        )
        pool.check_integrity()
    return blocks, len(hits)


def done(pool, blocks):
    pool.release(reversed(blocks))
    pool.check_integrity()


def ids(blocks):
    return [b.block_id for b in blocks]


def test_lowest_priority_first_then_lru_and_only_leaves():
    pool = BlockPool(6, BS, policy=PriorityPolicy())
    hi = C((T(0, None, 80),))
    a, _ = run(pool, list(range(8)), hi)  # blocks 0,1 at 80
    done(pool, a)
    b, _ = run(pool, list(range(100, 108)))  # blocks 2,3 at 35
    done(pool, b)
    c, _ = run(pool, list(range(200, 208)))  # blocks 4,5 at 35, newer than b
    done(pool, c)
    assert pool.blocks_by_priority() == {35: 4, 80: 2}
    # Need 3 blocks: the 35s go first, oldest chain first, tail before parent: 3, 2, 5.
    d, _ = run(pool, list(range(300, 312)))
    assert ids(d) == [3, 2, 5]
    assert pool.evictions_by_priority == {35: 3}
    done(pool, d)
    # Left at 35: block 4 (a leaf again since 5 went, released before d) and d; 4 goes first.
    e, _ = run(pool, list(range(400, 404)))
    assert ids(e) == [4]


def test_high_priority_leaf_protects_its_low_priority_parent():
    pool = BlockPool(3, BS, policy=PriorityPolicy())
    # block 0 at 10 (first range), block 1 at 90: the low parent is not a leaf.
    a, _ = run(pool, list(range(8)), C((T(0, 4, 10), T(4, 8, 90))))
    done(pool, a)
    b, _ = run(pool, list(range(100, 104)), C((T(0, None, 50),)))  # block 2 at 50
    done(pool, b)
    c, _ = run(pool, list(range(200, 204)))
    assert ids(c) == [2]  # 50 < 90, and block 0 (10) is no leaf
    done(pool, c)
    assert ids(run(pool, list(range(300, 308)))[0]) == [2, 1]  # 2 (35) first, then leaf 1 (90)


def test_duration_starts_at_release_and_expiry_falls_back_to_default():
    clock = FakeClock()
    events = []
    pool = BlockPool(4, BS, policy=PriorityPolicy(), clock=clock, events=events)
    sys_prompt = C((T(0, None, 90, 10_000),))  # 10 s at 90
    a, _ = run(pool, list(range(8)), sys_prompt)  # blocks 0,1
    clock.now = 50.0  # in use: the duration does not run
    pool.expire()
    assert [b.priority for b in a] == [90, 90] and a[0].expires_at is None
    done(pool, a)  # released at t=50: expires at 60
    assert a[0].expires_at == 60.0
    clock.now = 59.9
    assert pool.expire() == 0
    b, _ = run(pool, list(range(100, 108)))  # blocks 2,3 at 35
    done(pool, b)
    clock.now = 60.0
    assert pool.expire() == 2
    assert [x.priority for x in a] == [35, 35] and pool.blocks_by_priority() == {35: 4}
    updates = [e for e in events if isinstance(e, BlockUpdated)]
    assert [(u.old_priority, u.new_priority) for u in updates] == [(90, 35), (90, 35)]
    # Now LRU among equals: a (released earlier) goes first, tail first.
    c, _ = run(pool, list(range(200, 208)))
    assert ids(c) == [1, 0]


def test_allocate_applies_expiry_before_it_evicts():
    clock = FakeClock()
    pool = BlockPool(2, BS, policy=PriorityPolicy(), clock=clock)
    a, _ = run(pool, list(range(4)), C((T(0, None, 90, 1000),)))  # block 0 at 90 for 1 s
    done(pool, a)
    b, _ = run(pool, list(range(100, 104)))  # block 1 at 35, newer
    done(pool, b)
    clock.now = 2.0  # a expired: both 35, a older
    c, _ = run(pool, list(range(200, 204)))
    assert ids(c) == [0]


def test_reuse_takes_the_new_priority_and_always_replaces_the_duration():
    clock = FakeClock()
    pool = BlockPool(4, BS, policy=PriorityPolicy(), clock=clock)
    a, _ = run(pool, list(range(8)), C((T(0, None, 90, 5000),)))
    done(pool, a)
    # Reuse with a priority only on block 1: block 0 keeps 90 but loses its duration.
    b, hits = run(pool, list(range(8)), C((T(4, None, 20),)))
    assert hits == 2 and ids(b) == [0, 1]
    assert [(x.priority, x.duration_s) for x in b] == [(90, None), (20, None)]
    done(pool, b)
    clock.now = 1000.0
    assert pool.expire() == 0 and b[0].priority == 90  # no duration left to run out
    # Reuse without any config: priorities stay, durations cleared (already None).
    c, hits = run(pool, list(range(8)))
    assert hits == 2 and [x.priority for x in c] == [90, 20]
    done(pool, c)
    # Reuse with a new duration: it runs from this release.
    d, _ = run(pool, list(range(8)), C((T(0, None, 70, 2000),)))
    assert [x.priority for x in d] == [70, 70]
    done(pool, d)
    assert [x.expires_at for x in d] == [1002.0, 1002.0]
    clock.now = 1002.0
    assert pool.expire() == 2 and pool.blocks_by_priority() == {35: 2}


def test_set_retention_on_a_cached_block_restarts_its_duration():
    clock = FakeClock()
    pool = BlockPool(2, BS, policy=PriorityPolicy(), clock=clock)
    a, _ = run(pool, list(range(4)))
    done(pool, a)
    clock.now = 3.0
    pool.set_retention(a[0], 60, 1.0)
    pool.check_integrity()
    assert a[0].expires_at == 4.0
    with pytest.raises(RuntimeError):
        pool.set_retention(pool.blocks[1], 60, None)  # never registered


# Retention is typed from the edge to the sequence: ``LLM.generate`` converts the JSON form
# once (``as_retention``); the engine takes a ``KvCacheRetentionConfig`` or ``None`` and
# refuses anything else before it queues the request.
def test_checked_retention_passes_a_config_or_none_and_refuses_the_rest():
    config = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 8, 80)])
    assert checked_retention(config) is config
    assert checked_retention(None) is None
    with pytest.raises(ValueError) as info:
        checked_retention({"decode_retention_priority": 10})  # type: ignore[arg-type]
    assert str(info.value) == (
        "kv_cache_retention_config: expected a KvCacheRetentionConfig, got dict "
        "(convert the JSON form with kvreuse.cache.retention.as_retention)"
    )


def test_as_retention_converts_the_json_form_once():
    config = as_retention(
        {
            "token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 80}],
            "decode_retention_priority": 10,
        }
    )
    assert config == KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 8, 80)], 10)
    assert as_retention(config) is config and as_retention(None) is None


def test_the_engine_refuses_the_json_form_before_queueing(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    engine = llm.engine
    with pytest.raises(ValueError, match="^kv_cache_retention_config: expected a KvCacheRetentionConfig, got dict"):
        engine.add_request(
            "json", list(range(1, 13)), SamplingParams(max_tokens=1), retention={"decode_retention_priority": 10}
        )  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()
    engine.pool.check_integrity()
    assert engine.pool.num_used_blocks == 0
    # the same mapping through the edge (LLM.generate) is converted and applied
    llm.generate(
        [list(range(1, 13))],
        SamplingParams(max_tokens=1, temperature=0),
        retention={"token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 80}]},
    )
    assert engine.pool.blocks_by_priority() == {80: 2, 35: 1}
