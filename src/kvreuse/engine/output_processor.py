"""Post-forward token handling: one step's logits become its ``RequestOutput``s.

For each scheduled chunk, in plan order: a verified draft keeps its accepted prefix plus the
model's next token (``spec_decode.accepted_length``); a chunk that ends its prompt or
decodes samples one token (``sampler.sample_one``); a prefill chunk that does not only
commits its KV. Then, per request, the new tokens are appended one by one with their
logprobs (when asked) and checked for a stop (``stop_checker.check_stop``): tokens past a
stop or ``max_tokens`` are never emitted, a verified draft's KV is trimmed to what was kept,
and a finished request is handed to ``finish``. Engine thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvreuse.engine.logprobs import TokenLogprobs, requested_logprobs
from kvreuse.engine.outputs import RequestOutput
from kvreuse.engine.sampler import greedy_tokens, sample_one
from kvreuse.engine.spec_decode import accepted_length
from kvreuse.engine.stop_checker import check_stop

if TYPE_CHECKING:
    from kvreuse.cache.kv_cache_manager import KVCacheManager
    from kvreuse.engine.model_runner import SeqChunk
    from kvreuse.engine.scheduler import ScheduledChunk
    from kvreuse.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """The tokens one scheduled chunk produced this step, before stop checks."""

    item: ScheduledChunk
    first_row: int  # the logits row of tokens[0]; tokens[j] came from row first_row + j
    tokens: list[int]  # to append in order (a verified draft: the accepted ones, then the model's next)


class OutputProcessor:
    """Samples, checks stops, settles drafts and builds outputs. ``finish(seq)`` is called for
    each request that ends (the engine frees it). Counts what every step computed
    (``tokens_computed``) and drafted (``spec_draft_tokens``, ``spec_accepted_tokens``)."""

    def __init__(self, tokenizer: object, eos_token_ids: frozenset[int], kv: KVCacheManager,
                 finish: Callable[[Sequence], None], *, by_tier: bool) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.kv = kv
        self.finish = finish
        self.by_tier = by_tier  # outputs carry cached_tokens_by_tier (a tier below the device pool exists)
        self.tokens_computed = 0  # request tokens the forward computed (verified drafts included)
        self.spec_draft_tokens = 0  # prompt lookup: drafted tokens verified (all requests)
        self.spec_accepted_tokens = 0  # of those, accepted

    def process(self, plan: list[ScheduledChunk], chunks: list[SeqChunk], logits: torch.Tensor) -> list[RequestOutput]:
        """The outputs of one step: ``plan`` and its ``chunks`` in the same order, ``logits``
        ``[num_rows, vocab]`` fp32 as ``ModelRunner.execute`` returned them (one row per
        sampling chunk, ``1 + draft`` per verified draft). One output per sampling chunk."""
        now = time.perf_counter()  # every request's first token of this step: one time
        sampled = self._sample(plan, chunks, logits)
        new_logprobs = requested_logprobs(logits, [(s.item.seq, s.first_row + j, token) for s in sampled
                                                   for j, token in enumerate(s.tokens)])
        outputs: list[RequestOutput] = []
        for s in sampled:
            seq = s.item.seq
            if seq.first_token_time is None:
                seq.first_token_time = now
            new_text, reason, kept_logprobs = "", None, []
            for j, token in enumerate(s.tokens):
                seq.output_token_ids.append(token)
                logprob = new_logprobs.get((seq.request_id, s.first_row + j))
                if logprob is not None:
                    seq.output_logprobs.append(logprob)
                    kept_logprobs.append(logprob)
                piece, reason = check_stop(seq, self.tokenizer, self.eos_token_ids)
                new_text += piece
                if reason is not None:
                    break  # tokens accepted past a stop or max_tokens are never emitted
            kept = s.tokens[: j + 1]
            if s.item.num_draft_tokens:
                self._settle_draft(seq, s.item.num_draft_tokens, len(s.tokens) - 1, len(kept))
            if reason is not None:
                seq.finish_reason = reason
                self.finish(seq)
            outputs.append(self._output(seq, kept, new_text,
                                        kept_logprobs if seq.params.logprobs is not None else None))
        for item in plan:
            item.seq.draft_token_ids.clear()
        return outputs

    def _sample(self, plan: list[ScheduledChunk], chunks: list[SeqChunk], logits: torch.Tensor) -> list[SampledTokens]:
        """Each chunk's tokens (in plan order), its computed tokens committed: a verified draft
        is committed once the kept tokens are known (``_settle_draft``)."""
        sampled: list[SampledTokens] = []
        row = 0
        for item, chunk in zip(plan, chunks):
            seq = item.seq
            self.tokens_computed += item.num_new_tokens
            if item.num_draft_tokens:
                targets = greedy_tokens(logits[row : row + chunk.num_logits])  # [1 + draft]
                accepted = accepted_length(seq.draft_token_ids, targets)
                sampled.append(SampledTokens(item, row, seq.draft_token_ids[:accepted] + [targets[accepted]]))
                row += chunk.num_logits
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit_computed(seq)
            if chunk.sample:
                sampled.append(SampledTokens(item, row, [sample_one(logits[row], seq.params, seq.generator)]))
                row += 1
        return sampled

    def _settle_draft(self, seq: Sequence, drafted: int, accepted: int, kept: int) -> None:
        """After a verified draft: ``kept`` of the ``accepted + 1`` tokens were appended
        (fewer when a stop or max_tokens cut them). KV is valid for the last token before
        the step and every kept accepted draft token; full blocks of those become
        cacheable, and the blocks holding only rejected drafts go back to the pool."""
        seq.num_computed_tokens = seq.num_tokens - kept + min(kept, accepted)
        self.kv.commit_computed(seq)
        self.kv.trim(seq)
        assert seq.spec is not None  # only a speculating request is given a draft (spec_decode.draft_for)
        seq.spec.record(drafted, accepted)
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted

    def _output(self, seq: Sequence, new_ids: list[int], new_text: str,
                new_logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=list(seq.output_token_ids),
            new_token_ids=new_ids,
            text=seq.text,
            new_text=new_text,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens + seq.num_context_tokens,  # PML modules are prompt too
            num_cached_tokens=seq.num_cached_tokens,
            cached_tokens_by_tier=dict(seq.cached_tokens_by_tier) if self.by_tier else None,
            num_recomputed_tokens=0 if seq.context is None else seq.context.num_recomputed_tokens,
            ttft_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            logprobs=None if seq.params.logprobs is None else list(seq.output_logprobs),
            new_logprobs=new_logprobs,
            num_draft_tokens=0 if seq.spec is None else seq.spec.num_draft_tokens,
            num_accepted_tokens=0 if seq.spec is None else seq.spec.num_accepted_tokens,
        )
