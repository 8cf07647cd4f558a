"""Shared helpers for engine tests: a logits spy and a plain transformers reference."""

import torch

from kvreuse import LLM


class LogitsSpy:
    """Records every logits row the runner returns (a spy on the real runner, not a mock)."""

    def __init__(self, llm: LLM):
        self.rows: list[torch.Tensor] = []
        runner = llm.engine.runner
        original = runner.execute

        def execute(chunks):
            logits = original(chunks)
            self.rows.extend(logits.clone())
            return logits

        runner.execute = execute


@torch.inference_mode()
def reference_logits(model, token_ids: list[int]) -> torch.Tensor:
    """Plain transformers forward over the whole prompt: ``[len, vocab]`` fp32."""
    ids = torch.tensor([token_ids])
    return model(input_ids=ids, use_cache=False).logits[0].float()


def step_to_end(engine) -> dict:
    """Step ``engine`` until no request is left, ``check_integrity()`` after every step;
    returns each request's last output by request id."""
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_integrity()
    return outs
