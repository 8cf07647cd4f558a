"""ModelRunner: slot runs for in-place attention, and reading the context out of order."""

from __future__ import annotations

import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.engine.model_runner import MAX_RUNS, SeqChunk, _runs


def test_runs_split_at_gaps_and_give_up_past_the_limit():
    assert _runs([]) == ()
    assert _runs([5, 6, 7, 10, 11, 3]) == ((5, 3), (10, 2), (3, 1))
    many = [2 * i for i in range(MAX_RUNS)]  # MAX_RUNS runs of one slot: still read in place
    assert len(_runs(many)) == MAX_RUNS
    assert _runs(many + [1000]) == ()  # one more: gather instead


def _chunk(context: list[int], new: list[int]) -> SeqChunk:
    return SeqChunk.from_slots(
        token_ids=[7] * len(new),
        positions=list(range(len(context), len(context) + len(new))),
        new_slots=new,
        context_slots=context,
        context_positions=None,
        sample=True,
    )


def test_full_attention_reads_the_context_in_slot_order(tiny_llama, tiny_gemma3):
    # Two modules stored side by side (slots 0-15, 16-31), listed by a prompt in the other order.
    context, new = list(range(16, 32)) + list(range(0, 16)), [40, 41, 42]
    llama = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4, deterministic=False).engine.runner
    item = llama._prefill_item(0, _chunk(context, new))
    assert item.kv_runs == ((0, 32), (40, 3))  # one run for both modules
    assert item.kv_slots.tolist() == context + new  # the gather path keeps attention order
    # Sliding-window layers mask by position, which follows attention order: no reordering.
    gemma = LLM(loaded=tiny_gemma3, kv_cache_memory_gib=0.001, block_size=4).engine.runner
    assert gemma._prefill_item(0, _chunk(context, new)).kv_runs == ((16, 16), (0, 16), (40, 3))


def test_deterministic_reads_the_context_in_attention_order(tiny_llama):
    """Deterministic mode's kernels cut the keys into items of 256 in attention order, so the
    runs keep that order (slot order rounded a host-tier hit differently from its miss)."""
    context, new = list(range(16, 32)) + list(range(0, 16)), [40, 41, 42]
    runner = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4, deterministic=True).engine.runner
    item = runner._prefill_item(0, _chunk(context, new))
    assert item.kv_runs == ((16, 16), (0, 16), (40, 3))
    assert item.kv_slots.tolist() == context + new


def test_reordered_context_gives_the_same_logits_as_gathering_in_prompt_order(tiny_llama, monkeypatch):
    """Slot-order runs in place vs one gather in prompt order: same logits (1e-5)."""
    import kvreuse.engine.model_runner as model_runner

    torch.manual_seed(0)
    runner = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4).engine.runner
    runner.kv_cache.normal_()  # stand-in context K/V in every slot
    context = list(range(16, 32)) + list(range(0, 12)) + [60, 61]  # prompt order: three pieces
    chunk = _chunk(context, [40, 41, 42])
    assert runner._prefill_item(0, chunk).kv_runs == ((0, 12), (16, 16), (60, 2), (40, 3))
    in_place = runner.execute([chunk])
    monkeypatch.setattr(model_runner, "MAX_RUNS", 0)  # every chunk gathers its keys in prompt order
    assert runner._prefill_item(0, chunk).kv_runs == ()
    runner.kv_cache[:, :, :, 40:43].zero_()  # the new tokens' K/V are rewritten by the forward anyway
    gathered = runner.execute([chunk])
    torch.testing.assert_close(in_place, gathered, rtol=0, atol=1e-5)
    assert not torch.equal(in_place, runner.execute([_chunk(context[:-2], [40, 41, 42])]))  # the keys matter


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_long_context_decodes_read_in_place_and_match_the_gathered_batch(arch, request, monkeypatch):
    """Decodes past ``decode_in_place_min`` context tokens take the in-place path; tokens
    and logprobs equal the padded, gathered batch's (Gemma: across its sliding window)."""
    import kvreuse.engine.attention as attention

    loaded = request.getfixturevalue(arch)
    in_place_decodes = []
    attend_item = attention._attend_item
    monkeypatch.setattr(
        attention, "_attend_item", lambda item, *a: in_place_decodes.append(item.num_new == 1) or attend_item(item, *a)
    )
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(100, 2000, (n,), generator=gen).tolist() for n in (21, 6, 14)]
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=3)
    results = {}
    for threshold in (10**9, 12):  # everything batched / contexts of 12+ tokens in place
        in_place_decodes.clear()
        llm = LLM(loaded=loaded, kv_cache_memory_gib=0.001, block_size=4)
        llm.engine.runner.decode_in_place_min = threshold
        outs = llm.generate(prompts, params)
        results[threshold] = (
            [o.token_ids for o in outs],
            torch.tensor([[lp.logprob for lp in o.logprobs] for o in outs]),
        )
        llm.engine.pool.check_integrity()
        assert any(in_place_decodes) == (threshold == 12)
    assert results[12][0] == results[10**9][0]
    torch.testing.assert_close(results[12][1], results[10**9][1], rtol=0, atol=1e-5)


def test_runs_from_the_block_table_equal_the_runs_of_every_slot():
    """``_key_runs`` works per block; it equals ``_runs`` over the slots of every key in
    read order (the keys before the new tokens sorted when slot_order), and the table's
    slots equal the per-token formula."""
    import numpy as np

    from kvreuse.engine.attention import KeyTable
    from kvreuse.engine.model_runner import _key_runs

    rng = np.random.default_rng(0)
    for _ in range(300):
        bs = int(rng.choice([1, 2, 4, 16]))
        num_blocks = int(rng.integers(1, 12))
        ids = rng.permutation(64)[:num_blocks] if rng.random() < 0.5 else np.arange(num_blocks) + int(rng.integers(64))
        pool = np.setdiff1d(np.arange(200 * bs), (ids[:, None] * bs + np.arange(bs)).ravel())
        context = rng.permutation(pool)[: int(rng.integers(0, 6))] if rng.random() < 0.5 else pool[:0]
        if rng.random() < 0.3 and len(context):
            context = np.sort(context)
        num_own = int(rng.integers(1, num_blocks * bs + 1))
        num_new = int(rng.integers(1, num_own + 1))
        keys = KeyTable(context.astype(np.int64), ids.astype(np.int64), bs, num_own)
        own = [int(ids[t // bs]) * bs + t % bs for t in range(num_own)]
        assert keys.slots().tolist() == context.tolist() + own
        assert keys.own_slots(num_own - num_new, num_own).tolist() == own[num_own - num_new :]
        before = context.tolist() + own[: num_own - num_new]
        assert _key_runs(keys, num_new, slot_order=True) == _runs(sorted(before) + own[num_own - num_new :])
        assert _key_runs(keys, num_new, slot_order=False) == _runs(context.tolist() + own)
