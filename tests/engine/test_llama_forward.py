"""kvreuse's own Llama forward: which models take it, and that it computes what the
transformers forward computes (prefill, cached suffix, decode, batched) over the pool."""

from __future__ import annotations

import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.engine import llama_forward as llama


def test_only_plain_llama_models_take_the_own_forward(tiny_llama, tiny_gemma3):
    assert llama.supports(tiny_llama.model)
    assert not llama.supports(tiny_gemma3.model)
    with pytest.raises(ValueError, match="not a plain Llama"):
        llama.LlamaForward(tiny_gemma3.model)
    assert LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4).engine.runner.forward_impl == "kvreuse-llama"
    assert LLM(loaded=tiny_gemma3, kv_cache_memory_gib=0.001, block_size=4).engine.runner.forward_impl == "transformers"


def _prompt_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token logits after each prompt, through the engine (greedy, one token)."""
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, logprobs=5))
    assert all(o.logprobs[0].top_token_ids for o in outs)
    return torch.tensor([list(o.logprobs[0].top_logprobs) for o in outs])  # [B, 5]


def test_own_forward_matches_the_transformers_forward_through_the_engine(tiny_llama):
    rng = torch.Generator().manual_seed(3)
    shared = torch.randint(100, 2000, (23,), generator=rng).tolist()
    prompts = [shared + torch.randint(100, 2000, (n,), generator=rng).tolist() for n in (5, 9, 1)]
    runs = {}
    for impl in ("kvreuse-llama", "transformers"):
        llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4)
        runner = llm.engine.runner
        if impl == "transformers":
            runner._llama = None  # the transformers forward, our attention plugged in
        first = _prompt_logits(llm, prompts)  # cold prefill, batched
        again = _prompt_logits(llm, prompts)  # cached prefixes + short suffixes
        text = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))  # batched decode
        runs[impl] = (first, again, [o.token_ids for o in text])
        llm.engine.pool.check_integrity()
    own, ref = runs["kvreuse-llama"], runs["transformers"]
    torch.testing.assert_close(own[0], ref[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(own[1], ref[1], rtol=0, atol=1e-5)
    assert own[2] == ref[2]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_own_forward_follows_norm_weights_changed_after_it_was_built(dtype):
    """Random (not all-ones) RMSNorm weights, changed in place after the engine exists: the own
    forward (whose CPU norm keeps a doubled copy for one-row inputs) still matches the
    transformers forward on prefill, cached suffix and one-row decode."""
    from kvreuse.models.tiny import tiny_model

    loaded = tiny_model("llama", seed=1, dtype=dtype)
    llm = LLM(loaded=loaded, kv_cache_memory_gib=0.001, block_size=4)
    rng = torch.Generator().manual_seed(5)
    prompt = torch.randint(100, 2000, (13,), generator=rng).tolist()
    assert llm.engine.runner.forward_impl == "kvreuse-llama"
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))  # the doubled copies exist now
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if "norm" in name:
                p.mul_(torch.rand(p.shape, generator=rng, dtype=torch.float32).to(p.dtype) * 2 + 0.25)
    llm.engine.reset_prefix_cache()
    own = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    own_again = _prompt_logits(llm, [prompt + own.token_ids[:3]])  # cached prefix + a short suffix
    llm.engine.pool.check_integrity()
    ref_llm = LLM(loaded=loaded, kv_cache_memory_gib=0.001, block_size=4)
    ref_llm.engine.runner._llama = None  # the transformers forward, our attention plugged in
    ref = ref_llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    ref_again = _prompt_logits(ref_llm, [prompt + ref.token_ids[:3]])
    ref_llm.engine.pool.check_integrity()
    assert own.token_ids == ref.token_ids
    tol = 1e-5 if dtype == "float32" else 0.05
    for a, b in zip(own.logprobs, ref.logprobs):
        torch.testing.assert_close(torch.tensor(a.top_logprobs), torch.tensor(b.top_logprobs), rtol=0, atol=tol)
    torch.testing.assert_close(own_again, ref_again, rtol=0, atol=tol)
