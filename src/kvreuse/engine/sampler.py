"""Next-token selection: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from kvreuse.engine.sampling_params import SamplingParams


def sample_one(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick a token from fp32 ``logits`` ``[vocab]``. A seeded ``generator`` makes the
    choice independent of what else ran in the batch."""
    if params.greedy:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the first always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    gen = torch.Generator(device="cpu" if device.type == "cpu" else device)
    gen.manual_seed(seed)
    return gen
