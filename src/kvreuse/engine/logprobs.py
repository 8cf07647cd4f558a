"""Per-token log-probabilities of sampled tokens (``SamplingParams(logprobs=k)``).

Which distribution: the model's raw one, ``log_softmax`` of the fp32 logits *before*
temperature, top-k and top-p, as vLLM returns by default. A greedy token therefore has
rank 1 and the largest logprob; a sampled token may have any rank.

Cost: only the rows of requests that asked for logprobs go through ``log_softmax`` and
``topk``, in one batched call per step; a step where no request asked does no extra work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvreuse.sampling_params import MAX_LOGPROBS


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities at one output position."""

    token_id: int  # the token that was sampled
    logprob: float  # its log-probability under the raw model distribution
    rank: int  # 1 = the most likely token
    top_token_ids: tuple[int, ...]  # the k most likely tokens, most likely first
    top_logprobs: tuple[float, ...]  # their log-probabilities, descending (same order)


@torch.inference_mode()
def compute_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Logprobs of ``token_ids[i]`` under row ``i`` of fp32 ``logits`` ``[rows, vocab]``,
    with the ``ks[i]`` most likely tokens (``ks[i] <= MAX_LOGPROBS``; equal logprobs in token-id
    order, the list a function of the row alone). One ``log_softmax`` and one ``topk`` for all
    rows, one device-to-host copy."""
    if not token_ids:
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
    tokens = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)  # [rows]
    chosen = logp.gather(1, tokens[:, None])  # [rows, 1]
    ranks = (logp > chosen).sum(dim=1) + 1  # [rows]
    # one fixed k, whatever the rows asked: which tied tokens topk returns depends on k, so a
    # row's list must not depend on what another request in the step asked for (deterministic
    # mode: the same top list alone or batched); ties then go by token id
    k = min(MAX_LOGPROBS, logp.shape[-1]) if max(ks) else 0
    top = torch.topk(logp, k, dim=-1) if k else None  # values, indices: [rows, k]
    chosen_l, ranks_l = chosen[:, 0].tolist(), ranks.tolist()
    top_v = top.values.tolist() if top is not None else [[] for _ in token_ids]
    top_i = top.indices.tolist() if top is not None else [[] for _ in token_ids]
    out = []
    for i, t in enumerate(token_ids):
        pairs = sorted(zip(top_v[i], top_i[i]), key=lambda p: (-p[0], p[1]))[: ks[i]]
        out.append(
            TokenLogprobs(int(t), chosen_l[i], int(ranks_l[i]), tuple(p[1] for p in pairs), tuple(p[0] for p in pairs))
        )
    return out


def requested_logprobs(
    logits: torch.Tensor, rows: Sequence[tuple[Any, int, int]]
) -> dict[tuple[str, int], TokenLogprobs]:
    """Logprobs of the chosen tokens of ``rows`` (``(sequence, logits row, token)``), keyed by
    (request id, logits row), for the sequences whose params asked for them (none: no work)."""
    wanted = [(seq, row, token) for seq, row, token in rows if seq.params.logprobs is not None]
    if not wanted:
        return {}
    index = torch.tensor([row for _, row, _ in wanted], dtype=torch.long, device=logits.device)
    found = compute_logprobs(
        logits.index_select(0, index), [t for _, _, t in wanted], [seq.params.logprobs for seq, _, _ in wanted]
    )
    return {(seq.request_id, row): lp for (seq, row, _), lp in zip(wanted, found)}
