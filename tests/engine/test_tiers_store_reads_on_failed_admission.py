"""A waiting request whose prefix is on disk is re-matched against the stores on every
scheduler step while the device pool has no room: each failed admission reads (and
verifies) every stored block again on the engine thread, and counts them as disk hits."""

from kvreuse import LLM, SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0)


def executor(loaded, d):
    return LLM(loaded=loaded, kv_cache_memory_gib=0.00025, block_size=4, host_cache_memory_gib=0.001,
               disk_cache_dir=str(d))


def test_disk_hits_count_only_loaded_blocks(tiny_llama, tmp_path):
    prompt = [(i * 37) % 4000 + 10 for i in range(21)]  # 5 full blocks + 1 token
    first = executor(tiny_llama, tmp_path)
    first.generate(prompt, ONE)
    assert first.engine.host.below.flush(30)
    llm = executor(tiny_llama, tmp_path)  # restarted: the prefix is on disk only
    engine = llm.engine
    n = engine.pool.num_blocks
    long_prompt = [(i * 53) % 4000 + 7 for i in range(4 * (n - 3))]
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    engine.add_request("p", prompt, ONE)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
        steps += 1
    disk = engine.host.below.disk.stats()
    print("steps", steps, "loaded_blocks", engine.host.stats.loaded_blocks,
          "disk hits", disk["hits"], "PersistentStats.disk_hits", engine.host.below.stats.disk_hits)
    assert engine.host.stats.loaded_blocks == 5
    assert engine.host.below.stats.disk_hits == engine.host.stats.loaded_blocks
    assert disk["hits"] == engine.host.stats.loaded_blocks
