"""Concurrent requests with shared prefixes, aborts and preemption on a small device pool, a
host tier smaller than one request, and a disk tier: integrity after every step, and every
finished request's greedy output equals a no-caching engine's."""

import random

import pytest

from kvreuse import LLM, SamplingParams


def run(llm, prompts, aborts, check):
    engine = llm.engine
    outs = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    step = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.output_token_ids) if hasattr(o, "output_token_ids") else o
        step += 1
        if step in aborts:
            engine.abort_request(aborts[step])
        if check:
            engine.check_integrity()
    return outs


@pytest.mark.parametrize("arch,host_blocks", [("tiny_llama", 3), ("tiny_llama", 40), ("tiny_gemma3", 3)])
def test_stress(arch, host_blocks, request, tmp_path):
    loaded = request.getfixturevalue(arch)
    rng = random.Random(1)
    base = [rng.randrange(5, 4000) for _ in range(120)]
    prompts = []
    for i in range(14):
        cut = rng.choice([16, 32, 48, 64, 80, 96, 101])
        prompts.append(base[:cut] + [rng.randrange(5, 4000) for _ in range(rng.randrange(1, 12))])
    prompts += prompts[:6]  # repeats: their prefixes come back from host / disk
    ref = LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=4, enable_prefix_caching=False)
    probe = LLM(loaded=loaded, kv_cache_memory_gib=0.00025, block_size=4)
    bpb = probe.engine.kv_bytes_per_token * 4
    llm = LLM(loaded=loaded, kv_cache_memory_gib=34 * bpb / 2**30 + 1e-12, block_size=4,
              host_cache_memory_gib=host_blocks * bpb / 2**30 + 1e-12, disk_cache_dir=str(tmp_path),
              max_num_batched_tokens=32)
    assert llm.engine.host.pool.num_blocks == host_blocks
    print('device blocks', llm.engine.pool.num_blocks)
    want = run(ref, prompts, {}, False)
    got = run(llm, prompts, {3: "r2", 7: "r9"}, True)
    wrong = [rid for rid in got if got[rid] != want[rid]]
    s = llm.engine.host.stats
    print(arch, host_blocks, "offloaded", s.offloaded_blocks, "onboarded", s.onboarded_blocks,
          "loaded", s.loaded_blocks, "preemptions", llm.engine.stats().num_preemptions, "wrong", wrong)
    assert not wrong
