"""Retention is typed from the edge to the sequence: ``LLM.generate`` converts the JSON form
once (``as_retention``); the engine takes a ``KvCacheRetentionConfig`` or ``None`` and
refuses anything else before it queues the request."""

from __future__ import annotations

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.cache.retention import KvCacheRetentionConfig, TokenRangeRetentionConfig, as_retention, checked_retention


def test_checked_retention_passes_a_config_or_none_and_refuses_the_rest():
    config = KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 8, 80)])
    assert checked_retention(config) is config
    assert checked_retention(None) is None
    with pytest.raises(ValueError) as info:
        checked_retention({"decode_retention_priority": 10})  # type: ignore[arg-type]
    assert str(info.value) == ("kv_cache_retention_config: expected a KvCacheRetentionConfig, got dict "
                               "(convert the JSON form with kvreuse.cache.retention.as_retention)")


def test_as_retention_converts_the_json_form_once():
    config = as_retention({"token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 80}],
                           "decode_retention_priority": 10})
    assert config == KvCacheRetentionConfig([TokenRangeRetentionConfig(0, 8, 80)], 10)
    assert as_retention(config) is config and as_retention(None) is None


def test_the_engine_refuses_the_json_form_before_queueing(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4)
    engine = llm.engine
    with pytest.raises(ValueError, match="^kv_cache_retention_config: expected a KvCacheRetentionConfig, got dict"):
        engine.add_request("json", list(range(1, 13)), SamplingParams(max_tokens=1),
                           retention={"decode_retention_priority": 10})  # type: ignore[arg-type]
    assert not engine.has_unfinished_requests()
    engine.pool.check_integrity()
    assert engine.pool.num_used_blocks == 0
    # the same mapping through the edge (LLM.generate) is converted and applied
    llm.generate([list(range(1, 13))], SamplingParams(max_tokens=1, temperature=0),
                 retention={"token_range_retention_configs": [{"token_start": 0, "token_end": 8, "priority": 80}]})
    assert engine.pool.blocks_by_priority() == {80: 2, 35: 1}
