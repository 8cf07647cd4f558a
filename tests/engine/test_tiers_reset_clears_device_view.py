"""reset_prefix_cache with a host tier while a request runs: the host pool, emptied, emits
AllBlocksCleared (no level), and a consumer (the router's KVIndex) drops the running
request's device blocks that the engine still holds and reports in its snapshot."""

from kvreuse import LLM, SamplingParams
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import AllBlocksCleared, take_snapshot
from kvreuse.router.index import KVIndex, index_key

ONE = SamplingParams(max_tokens=1, temperature=0)


def test_reset_with_running_request_keeps_consumer_equal_to_state(tiny_llama):
    buffer = EventBuffer(100000)
    llm = LLM(loaded=tiny_llama, events=buffer, kv_cache_memory_gib=0.00025, block_size=4,
              host_cache_memory_gib=0.001)
    engine = llm.engine
    n = 4 * (engine.pool.num_blocks - 2) + 1
    a = [(i * 37) % 4000 + 10 for i in range(n)]
    b = [(i * 53) % 4000 + 7 for i in range(n)]
    llm.generate(a, ONE)
    llm.generate(b, ONE)  # a's blocks go down to the host
    assert engine.host.pool.num_cached_blocks > 0
    # a request that is running (prompt computed and registered, still decoding)
    engine.add_request("r", [(i * 11) % 4000 + 3 for i in range(21)], SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.pool.num_used_blocks > 0
    index = KVIndex()
    index.add_executor("e")
    for event in buffer.get_events(after_id=-1, max_events=10**9):
        index.apply("e", event)
    engine.reset_prefix_cache()
    new = buffer.get_events(after_id=index.mirror("e").last_event_id, max_events=10**9)
    for event in new:
        assert index.apply("e", event)
    truth: dict[int, frozenset[str]] = {}
    for b in take_snapshot(list(engine.cache_pools()), 0).blocks:
        truth[index_key(b.block_hash)] = truth.get(index_key(b.block_hash), frozenset()) | {b.cache_level}
    print("events after reset:", [type(e.data).__name__ for e in new])
    print("engine still holds", len(truth), "registered blocks; consumer sees", len(index.mirror("e").levels))
    assert index.mirror("e").levels == truth
    engine.check_integrity()
