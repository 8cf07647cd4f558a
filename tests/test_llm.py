"""The offline API's prompt forms (kvreuse/llm.py): text, token ids and vLLM's ``TextPrompt`` /
``TokensPrompt`` dicts give the same request; anything else is a TypeError naming the forms."""

from __future__ import annotations

import pytest

from kvreuse import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=16)


def test_vllm_prompt_dicts_are_the_text_and_ids_they_hold(llm):
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ids = llm.tokenizer.encode("The capital of France is")
    want = list(llm.generate([ids], params)[0].token_ids)
    outs = llm.generate([{"prompt_token_ids": ids}, {"prompt": "The capital of France is"}, ids], params)
    assert [list(o.token_ids) for o in outs] == [want, want, want]
    [one] = llm.generate({"prompt_token_ids": ids}, params)  # a single dict is one prompt
    assert list(one.token_ids) == want
    llm.engine.pool.check_integrity()


@pytest.mark.parametrize(
    "prompt, names",
    [
        ({"prompt_ids": [1, 2]}, "got keys ['prompt_ids']"),
        ({"prompt": [1, 2]}, "got keys ['prompt']"),
        ({"prompt_token_ids": ["a"]}, "got list"),
        ({"prompt_token_ids": "hello"}, "got keys ['prompt_token_ids']"),
        ([[1, 2], 3.5], "got float"),
    ],
)
def test_other_prompt_forms_name_the_accepted_ones(llm, prompt, names):
    with pytest.raises(TypeError, match="prompt: ") as err:
        llm.generate(prompt, SamplingParams(max_tokens=1))
    assert names in str(err.value)
    llm.engine.pool.check_integrity()
