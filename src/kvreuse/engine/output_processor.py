"""Post-forward token handling: one step's logits become its ``RequestOutput``s.

For each scheduled chunk, in plan order: a verified draft keeps its accepted prefix plus the
model's next token (``spec_decode.accepted_length``); a chunk that ends its prompt or
decodes samples one token (``sampler.sample_one``); a prefill chunk that does not only
commits its KV. Then, per request, the new tokens are appended one by one with their
logprobs (when asked) and checked for a stop (``stop_checker.check_stop``): tokens past a
stop or ``max_tokens`` are never emitted, a verified draft's KV is trimmed to what was kept,
and a finished request is handed to ``finish``. Engine thread only.

A request whose post-processing raises (its sampling, logprobs, draft acceptance, stop
check or detokenising) fails alone: it ends with ``finish_reason="error"`` and the error on
its output (``fail``); every other request of the step is processed as if it were not there.
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
from kvreuse.engine.sequence import SequenceStatus
from kvreuse.engine.spec_decode import accepted_length
from kvreuse.engine.step_faults import StepFaults
from kvreuse.engine.stop_checker import check_stop

if TYPE_CHECKING:
    from kvreuse.cache.kv_cache_manager import KVCacheManager
    from kvreuse.engine.model_runner import SeqChunk
    from kvreuse.engine.scheduler import ScheduledChunk
    from kvreuse.engine.sequence import Sequence

Failures = dict[str, tuple["Sequence", Exception]]  # request id -> (its sequence, what its processing raised)


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

    def __init__(
        self,
        tokenizer: object,
        eos_token_ids: frozenset[int],
        kv: KVCacheManager,
        finish: Callable[[Sequence], None],
        *,
        by_tier: bool,
        faults: StepFaults | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.faults = faults or StepFaults()  # test-only (engine/step_faults.py): none unless asked
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
        sampling chunk, ``1 + draft`` per verified draft). One output per sampling chunk:
        first those of requests whose post-processing raised (``fail``), then the others in
        plan order."""
        now = time.perf_counter()  # every request's first token of this step: one time
        failed: Failures = {}
        sampled = self._sample(plan, chunks, logits, failed)
        new_logprobs = self._logprobs(logits, sampled, failed)
        outputs: list[RequestOutput] = []
        for got in sampled:
            seq = got.item.seq
            if seq.request_id in failed:
                continue
            try:
                outputs.append(self._append(got, new_logprobs, now))
            except Exception as exc:  # noqa: BLE001 - this request's alone: it fails, the step goes on
                failed[seq.request_id] = (seq, exc)
        for item in plan:
            item.seq.draft_token_ids.clear()
        return [self.fail(seq, exc) for seq, exc in failed.values()] + outputs

    def fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        """End ``seq`` with ``exc``: ``finish_reason="error"``, its blocks freed (``finish``:
        nothing uncommitted is registered), its output carrying the message in ``error``."""
        seq.finish_reason = "error"
        if seq.status != SequenceStatus.FINISHED:
            self.finish(seq)
        output = self._output(seq, [], "", None)
        output.error = f"{type(exc).__name__}: {exc}"
        return output

    def _append(
        self, got: SampledTokens, new_logprobs: dict[tuple[str, int], TokenLogprobs], now: float
    ) -> RequestOutput:
        """Append one chunk's tokens to its request, stopping where a stop says; its output."""
        seq = got.item.seq
        if seq.first_token_time is None:
            seq.first_token_time = now
        new_text, reason, kept_logprobs = "", None, []
        for j, token in enumerate(got.tokens):
            seq.output_token_ids.append(token)
            logprob = new_logprobs.get((seq.request_id, got.first_row + j))
            if logprob is not None:
                seq.output_logprobs.append(logprob)
                kept_logprobs.append(logprob)
            piece, reason = check_stop(seq, self.tokenizer, self.eos_token_ids)
            new_text += piece
            if reason is not None:
                break  # tokens accepted past a stop or max_tokens are never emitted
        kept = got.tokens[: j + 1]
        if got.item.num_draft_tokens:
            self._settle_draft(seq, got.item.num_draft_tokens, len(got.tokens) - 1, len(kept))
        if reason is not None:
            seq.finish_reason = reason
            self.finish(seq)
        return self._output(seq, kept, new_text, kept_logprobs if seq.params.logprobs is not None else None)

    def _sample(
        self, plan: list[ScheduledChunk], chunks: list[SeqChunk], logits: torch.Tensor, failed: Failures
    ) -> list[SampledTokens]:
        """Each chunk's tokens (in plan order), its computed tokens committed: a verified draft
        is committed once the kept tokens are known (``_settle_draft``). A chunk whose
        sampling raises goes to ``failed``."""
        sampled: list[SampledTokens] = []
        row = 0
        for item, chunk in zip(plan, chunks):
            first_row, row = row, row + (chunk.num_logits if chunk.sample else 0)
            self.tokens_computed += item.num_new_tokens
            try:
                tokens = self._tokens(item, chunk, logits, first_row)
            except Exception as exc:  # noqa: BLE001 - this request's alone
                failed[item.seq.request_id] = (item.seq, exc)
                continue
            if tokens is not None:
                sampled.append(SampledTokens(item, first_row, tokens))
        return sampled

    def _tokens(self, item: ScheduledChunk, chunk: SeqChunk, logits: torch.Tensor, first_row: int) -> list[int] | None:
        """The tokens ``item`` produced (``None``: a prefill chunk that does not end its prompt)."""
        seq = item.seq
        if not item.num_draft_tokens:
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit_computed(seq)
            if not chunk.sample:
                return None
        self.faults.check_sample(seq.request_id, len(seq.output_token_ids))  # test-only: raises when asked to
        if item.num_draft_tokens:
            targets = greedy_tokens(logits[first_row : first_row + chunk.num_logits])  # [1 + draft]
            accepted = accepted_length(seq.draft_token_ids, targets)
            return seq.draft_token_ids[:accepted] + [targets[accepted]]
        return [sample_one(logits[first_row], seq.params, seq.generator)]

    def _logprobs(
        self, logits: torch.Tensor, sampled: list[SampledTokens], failed: Failures
    ) -> dict[tuple[str, int], TokenLogprobs]:
        """``requested_logprobs`` of every sampled token, in one call; if that raises, one call
        per request, a request whose call raises going to ``failed``."""

        def rows(group: list[SampledTokens]) -> list[tuple[Sequence, int, int]]:
            return [(s.item.seq, s.first_row + j, token) for s in group for j, token in enumerate(s.tokens)]

        try:
            return requested_logprobs(logits, rows(sampled))
        except Exception:  # noqa: BLE001 - found per request below
            found: dict[tuple[str, int], TokenLogprobs] = {}
            for s in sampled:
                try:
                    found |= requested_logprobs(logits, rows([s]))
                except Exception as exc:  # noqa: BLE001 - this request's alone
                    failed[s.item.seq.request_id] = (s.item.seq, exc)
            return found

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

    def _output(
        self, seq: Sequence, new_ids: list[int], new_text: str, new_logprobs: list[TokenLogprobs] | None
    ) -> RequestOutput:
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
