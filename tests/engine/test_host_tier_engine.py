"""The host tier through the real engine on tiny random-weight models: a prefix evicted from
the device pool is offloaded, onboarded on its next use, counted as cached tokens, and
gives the same logits as no caching (fp32, within 1e-4)."""

import pytest

from kvreuse import LLM, SamplingParams
from tests.engine_helpers import LogitsSpy, reference_logits

ONE = SamplingParams(max_tokens=1, temperature=0)


def tiny_llm(loaded, **kwargs):
    # ~0.25 MB of device KV for the tiny models: a few dozen 4-token blocks
    return LLM(loaded=loaded, kv_cache_memory_gib=kwargs.pop("device_gib", 0.00025), block_size=4, **kwargs)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_prefix_evicted_to_host_is_onboarded_exactly(arch, request):
    loaded = request.getfixturevalue(arch)
    llm = tiny_llm(loaded, host_cache_memory_gib=0.001)
    engine = llm.engine
    device_blocks = engine.pool.num_blocks
    assert engine.host is not None and engine.host.pool.num_blocks > device_blocks
    n = 4 * (device_blocks - 2) + 1  # fills the device pool but for one block
    a = [(i * 37) % 4000 + 10 for i in range(n)]
    b = [(i * 53) % 4000 + 7 for i in range(n)]
    spy = LogitsSpy(llm)
    assert llm.generate(a, ONE)[0].num_cached_tokens == 0
    engine.check_integrity()
    llm.generate(b, ONE)  # evicts a's blocks: they go down to the host
    engine.check_integrity()
    assert engine.host.stats.offloaded_blocks >= (n - 1) // 4 - 1
    again = llm.generate(a, ONE)[0]
    engine.check_integrity()
    assert again.num_cached_tokens == n - 1  # every full block, from the host
    assert engine.host.stats.onboarded_blocks >= (n - 1) // 4 - 1
    ref = reference_logits(loaded.model, a)
    assert (spy.rows[-1] - ref[-1]).abs().max().item() <= 1e-4


def test_gate_above_every_priority_offloads_nothing(tiny_llama):
    llm = tiny_llm(tiny_llama, host_cache_memory_gib=0.001, host_offload_min_priority=101)
    n = 4 * (llm.engine.pool.num_blocks - 2) + 1
    a, b = list(range(10, 10 + n)), list(range(2000, 2004 + n))  # b takes the whole pool
    llm.generate(a, ONE)
    llm.generate(b, ONE)
    assert llm.engine.host.stats.offloaded_blocks == 0 and llm.engine.host.stats.skipped_blocks > 0
    assert llm.generate(a, ONE)[0].num_cached_tokens == 0
    llm.engine.check_integrity()


def test_reset_prefix_cache_drops_the_host_tier_too(tiny_llama):
    llm = tiny_llm(tiny_llama, host_cache_memory_gib=0.001)
    n = 4 * (llm.engine.pool.num_blocks - 2) + 1
    a, b = list(range(10, 10 + n)), list(range(2000, 2000 + n))
    llm.generate(a, ONE)
    llm.generate(b, ONE)
    assert llm.engine.host.pool.num_cached_blocks > 0
    llm.engine.reset_prefix_cache()
    assert llm.engine.host.pool.num_cached_blocks == 0 and llm.engine.pool.num_cached_blocks == 0
    assert llm.generate(a, ONE)[0].num_cached_tokens == 0
    llm.engine.check_integrity()


def test_host_settings_are_validated_naming_the_flag(tiny_llama):
    with pytest.raises(ValueError, match="--host-cache-memory"):
        tiny_llm(tiny_llama, host_cache_memory_gib=-1)
    with pytest.raises(ValueError, match="--host-offload-min-priority"):
        tiny_llm(tiny_llama, host_cache_memory_gib=0.001, host_offload_min_priority=200)
