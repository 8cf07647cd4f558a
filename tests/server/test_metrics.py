"""SPEC 8, metric by metric: every one is on ``/metrics`` with an exact value after a known
sequence of requests on a server of its own (8 blocks of 16 tokens, events on).

The story:
  A  40 tokens at priority 80  -> 2 full blocks cached at 80 (the partial third is freed)
  B  40 other tokens            -> 2 full blocks cached at 35 (4 of 8 blocks now cached)
  C  100 tokens                 -> needs 7 blocks, 4 free: evicts B's 2 blocks (35) and A's
                                   leaf block (80); caches 6 full blocks at 35
  C again, 3 output tokens      -> 96 prompt tokens hit; 4 prompt + 2 decode tokens computed
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvreuse import LLM, SamplingParams
from kvreuse.server.metrics import _tier_metrics

from .fresh_app import fresh_client
from .helpers import BLOCK_SIZE, wait_idle

BYTES_PER_BLOCK = BLOCK_SIZE * 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
EVENT_BUFFER = 4  # small, so some events are certainly dropped


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples, name: str, **labels) -> float:
    return samples[(name, frozenset({"model_name": "tiny", **labels}.items()))]


def test_every_spec_metric_has_its_exact_value(tiny_llama):
    a = [(i * 7) % 900 + 1000 for i in range(40)]
    b = [(i * 11) % 900 + 2000 for i in range(40)]
    c = [(i * 13) % 900 + 3000 for i in range(100)]
    high = {"token_range_retention_configs": [{"token_start": 0, "token_end": None, "priority": 80}]}
    with fresh_client(
        tiny_llama, kv_cache_memory_gib=8 * BYTES_PER_BLOCK / 2**30, event_buffer_max_size=EVENT_BUFFER
    ) as (client, engine):
        assert engine.engine.pool.num_blocks == 8
        for prompt, extra in (
            (a, {"kv_cache_retention_config": high}),
            (b, {}),
            (c, {}),
            (c, {"max_tokens": 3, "ignore_eos": True}),
        ):
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
            r = client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
        wait_idle(engine)  # the engine's stats snapshot now includes the last step
        events = engine.engine.events.stats()
        m = _samples(client.get("/metrics").text)

    # prefix-cache queries and hits (tokens), hit rate
    assert _value(m, "kvreuse:prefix_cache_queries_total") == 40 + 40 + 100 + 100
    assert _value(m, "kvreuse:prefix_cache_hits_total") == 96
    assert _value(m, "kvreuse:prefix_cache_hit_rate") == 96 / 280
    # evictions by priority, blocks held by priority (and the block counts they add up to)
    assert _value(m, "kvreuse:evictions_total", priority="35") == 2
    assert _value(m, "kvreuse:evictions_total", priority="80") == 1
    assert _value(m, "kvreuse:blocks_by_priority", priority="35") == 6
    assert _value(m, "kvreuse:blocks_by_priority", priority="80") == 1
    assert (
        _value(m, "kvreuse:num_blocks_free"),
        _value(m, "kvreuse:num_blocks_cached"),
        _value(m, "kvreuse:num_blocks_used"),
        _value(m, "kvreuse:num_blocks_total"),
    ) == (1, 7, 0, 8)
    # TTFT and per-token latency histograms: 4 first tokens, 2 later tokens, 1 request with >1 token
    assert _value(m, "kvreuse:time_to_first_token_seconds_count") == 4
    assert _value(m, "kvreuse:inter_token_latency_seconds_count") == 2
    assert _value(m, "kvreuse:request_time_per_output_token_seconds_count") == 1
    assert _value(m, "kvreuse:e2e_request_latency_seconds_count") == 4
    # tokens computed vs reused
    assert _value(m, "kvreuse:prompt_tokens_total") == 280
    assert _value(m, "kvreuse:prompt_tokens_computed_total") == 280 - 96
    assert _value(m, "kvreuse:prompt_tokens_reused_total") == 96
    assert _value(m, "kvreuse:tokens_computed_total") == 40 + 40 + 100 + 4 + 2
    assert _value(m, "kvreuse:generation_tokens_total") == 1 + 1 + 1 + 3
    # no documents and no seam repair in this story (tests/server/test_document_routes.py counts them)
    assert _value(m, "kvreuse:seam_repair_tokens_total") == 0
    assert _value(m, "kvreuse:document_tokens_computed_total") == 0
    assert _value(m, "kvreuse:document_tokens_reused_total") == 0
    assert _value(m, "kvreuse:request_success_total", finished_reason="length") == 4
    # events dropped: every event but the newest EVENT_BUFFER ones
    assert events["last_event_id"] + 1 > EVENT_BUFFER
    assert _value(m, "kvreuse:kv_events_dropped_total") == events["last_event_id"] + 1 - EVENT_BUFFER
    assert _value(m, "kvreuse:kv_events_last_id") == events["last_event_id"]


# /metrics exports the disk store's gauges (entries, bytes) inside a Prometheus *counter*
# family (kvreuse:disk_tier_events), so a counter goes down when a block file is refused and
# deleted (Prometheus reads a decrease as a counter reset).
ONE = SamplingParams(max_tokens=1, temperature=0)
PROMPT = [(i * 37) % 4000 + 10 for i in range(61)]


def disk_executor(loaded, d):
    return LLM(
        loaded=loaded, kv_cache_memory_gib=0.001, block_size=4, host_cache_memory_gib=0.001, disk_cache_dir=str(d)
    )


def disk_family(engine):
    fams = {f.name: f for f in _tier_metrics(engine.stats(), [], [])}
    fam = fams["kvreuse:disk_tier_events"]
    return fam.type, {s.labels["event"]: s.value for s in fam.samples}


def test_disk_store_counters_never_decrease(tiny_llama, tmp_path):
    first = disk_executor(tiny_llama, tmp_path)
    first.generate(PROMPT, ONE)
    assert first.engine.host.below.flush(30)
    llm = disk_executor(tiny_llama, tmp_path)
    disk = llm.engine.host.below.disk
    victim = next(p for p in tmp_path.rglob("*.kvb"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    kind, before = disk_family(llm.engine)
    key = next(k for k in list(disk._index) if disk._path(k) == victim)
    tiers = llm.engine.host.below
    assert disk.get(key, shape=tiers.block_shape, dtype=tiers.dtype) is None  # refused, deleted (admission's path)
    kind, after = disk_family(llm.engine)
    print(kind, "before", before, "after", after)
    decreased = {k: (before[k], after[k]) for k in before if after.get(k, 0) < before[k]}
    assert kind == "counter"
    assert not decreased, f"counter samples went down: {decreased}"
