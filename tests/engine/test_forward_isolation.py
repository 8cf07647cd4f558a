"""A step failure one request causes costs only that request: the forward is retried split
until the failing chunk is found, a request whose post-processing raises is dropped from the
step; the others' greedy tokens equal those of a run without the faulty request, the pool
stays consistent and every block comes back. A failure nobody's request explains still fails
the step (the caller fails everyone)."""

from __future__ import annotations

import pytest
import torch

from kvreuse.engine.forward_isolation import isolate
from kvreuse.engine.llm_engine import EngineConfig, LLMEngine
from kvreuse.sampling_params import SamplingParams
from tests.engine_helpers import step_to_end

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = {f"ok-{i}": [(j * 31 + i * 97) % 3000 + 20 for j in range(24 + 9 * i)] for i in range(3)}
# shares ok-0's first two blocks (cached by then): freeing it must not free them
BAD_PROMPT = PROMPTS["ok-0"][:16] + list(range(3100, 3121))


def _engine(loaded, **config) -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory_gib=0.005, block_size=8, max_model_len=256, **config), loaded)


def _run(engine: LLMEngine, *, with_bad: bool) -> dict:
    """The three ok requests, three steps in (mid-decode), then (``with_bad``) the bad one."""
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, GREEDY)
    outs = {}
    for _ in range(3):
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_integrity()
    if with_bad:
        engine.add_request("bad-1", BAD_PROMPT, GREEDY)
    return outs | step_to_end(engine)


@pytest.mark.parametrize(
    ("stage", "speculative_tokens"), [("forward", 0), ("sample", 0), ("forward@4", 3), ("sample@2", 0)]
)
def test_the_failing_request_errors_alone_and_the_others_answer_as_without_it(tiny_llama, stage, speculative_tokens):
    """``@N``: the bad request fails once it has N tokens, in a decode batched with the others."""
    undisturbed = _run(_engine(tiny_llama, speculative_tokens=speculative_tokens), with_bad=False)
    stage, _, after = stage.partition("@")
    fault = f"{stage}:bad-" + (f"@{after}" if after else "")
    engine = _engine(tiny_llama, speculative_tokens=speculative_tokens, debug_step_faults=(fault,))
    outs = _run(engine, with_bad=True)

    bad = outs["bad-1"]
    assert (bad.finished, bad.finish_reason) == (True, "error")
    assert len(bad.output_token_ids) == int(after or 0)  # it failed on the step after its Nth token
    assert bad.error == (
        f"InjectedFault: injected {'forward' if stage == 'forward' else 'post-processing'} fault (request bad-1)"
    )
    for request_id in PROMPTS:
        assert outs[request_id].error is None and outs[request_id].finish_reason == "length"
        assert outs[request_id].output_token_ids == undisturbed[request_id].output_token_ids
        assert len(outs[request_id].output_token_ids) == 12
    engine.check_integrity()
    stats = engine.stats()
    assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert list(engine.requests()) == []


def test_a_request_alone_in_its_step_fails_alone_and_the_engine_serves_on(tiny_llama):
    engine = _engine(tiny_llama, debug_step_faults=("forward:bad-",))
    engine.add_request("bad-1", BAD_PROMPT, GREEDY)
    [out] = engine.step()
    assert (out.request_id, out.finish_reason, out.error) == (
        "bad-1",
        "error",
        "InjectedFault: injected forward fault (request bad-1)",
    )
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.stats().num_used_blocks == 0
    engine.add_request("ok-0", PROMPTS["ok-0"], GREEDY)
    assert len(step_to_end(engine)["ok-0"].output_token_ids) == 12


def test_a_forward_every_chunk_fails_alone_is_raised(tiny_llama, monkeypatch):
    """Not one request's doing (the device broke): the step raises; the caller fails all."""
    engine = _engine(tiny_llama)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, GREEDY)

    def broken(chunks):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()


class _Item:
    def __init__(self, name: str) -> None:
        self.name = name


def test_isolate_bisects_to_the_failing_chunks_and_keeps_the_others_rows_in_order():
    plan = [_Item(c) for c in "abcdefg"]
    chunks = [f"chunk-{c}" for c in "abcdefg"]  # one logits row each, valued by position
    calls: list[str] = []

    def forward(part, part_chunks):
        calls.append("".join(item.name for item in part))
        if any(item.name in "ce" for item in part):
            raise ValueError("bad row")
        return torch.tensor([[float("abcdefg".index(item.name))] for item in part])

    ran = isolate(forward, plan, chunks)
    assert [item.name for item in ran.plan] == list("abdfg")
    assert ran.chunks == [f"chunk-{c}" for c in "abdfg"]
    assert ran.all_logits()[:, 0].tolist() == [0.0, 1.0, 3.0, 5.0, 6.0]
    assert [(item.name, str(exc)) for item, exc in ran.failed] == [("c", "bad row"), ("e", "bad row")]
    assert calls == ["abcdefg", "abc", "a", "bc", "b", "c", "defg", "de", "d", "e", "fg"]


def test_isolate_costs_one_forward_when_nothing_fails():
    calls = []

    def forward(part, part_chunks):
        calls.append(len(part))
        return torch.zeros(len(part), 4)

    ran = isolate(forward, [_Item("a"), _Item("b")], ["x", "y"])
    assert calls == [2] and ran.failed == [] and ran.all_logits().shape == (2, 4)
