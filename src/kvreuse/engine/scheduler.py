"""Continuous batching: every step mixes decodes and (chunks of) prefills under a token
budget; waiting requests are admitted first-come first-served when their blocks fit.

Decode first: every running sequence with one token to compute is planned before any
prefill, and while anyone decodes, the prefill tokens of a step are capped by
``max_prefill_tokens_while_decoding`` (vLLM's chunked prefill with decode priority), so a
stream's inter-token latency does not grow with other requests' prompts.

A sequence always computes the tokens ``[num_computed_tokens, num_tokens)``: a prefill
is the whole prompt (minus cache hits), a decode is the one token sampled last step, and
a preempted sequence simply recomputes everything it had (vLLM's recompute preemption).
Memory pressure therefore never crashes: the youngest running request goes back to the
front of the queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvreuse.cache.kv_cache_manager import KVCacheManager
from kvreuse.engine.sequence import Sequence, SequenceStatus

# Prefill tokens a decoding step carries when no setting says. On a CPU a prefill token at a
# 1,500-token context costs ~2 ms a step (135M, 2 cores; attention over the context is most of
# it), so a 64-token chunk beside three decodes took 110-175 ms in `kvreuse serve` against a 9 ms
# lone step. Measured over HTTP (4 clients x 3 requests, a cached 1,500-token system prompt + 128
# new tokens, 64 out; AMD EPYC, 2 threads): cap 64 -> ITL p99 132-159 ms, TTFT p50 514-892 ms;
# 16 -> 61-63 ms, 463-512 ms, the same output tok/s; 8 -> 47-50 ms but p50 ITL and throughput
# worse (docs/benchmarks.md). A GPU computes a few thousand prefill tokens in a decode step's time
# (vLLM's chunked-prefill budget). The CPU cap grows by 4 tokens per decoding stream: a step of 16
# decodes already costs ~70 ms, and 16 prefill tokens a step then left new requests waiting (TTFT
# p50 5.8 s at 16 streams against 0.75 s with 64; ITL p99 94 vs 212 ms), so the prefill share of a
# step stays about the same as the batch grows.
_DEFAULT_PREFILL_CAP = {"cpu": 16, "cuda": 2048}
_DEFAULT_PREFILL_PER_DECODE = {"cpu": 4}


def prefill_cap(cap: int | None, per_decode: int, decodes: int) -> int | None:
    """Prefill tokens a step (or a context pass's chunk) may carry while ``decodes`` requests
    decode: ``cap`` raised to ``per_decode`` per decoding request when that is more; None: no cap.
    The one rule the scheduler and the prefill pacer share."""
    return None if cap is None else max(cap, per_decode * decodes)


def default_prefill_per_decode(setting: int | None, device_type: str) -> int:
    """Prefill tokens the cap grows by per decoding sequence: the device's default when the cap is
    the default (``setting`` None), else 0 (a cap given is kept as given)."""
    return _DEFAULT_PREFILL_PER_DECODE.get(device_type, 0) if setting is None else 0


def default_prefill_cap(setting: int | None, device_type: str) -> int | None:
    """The scheduler's ``max_prefill_tokens_while_decoding`` for a ``--max-prefill-tokens-while-decoding``
    value: None picks the device's default, 0 means no cap (None), N is N."""
    if setting is None:
        return _DEFAULT_PREFILL_CAP.get(device_type, 2048)
    return setting or None


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int  # tokens computed for ``seq`` this step, from its num_computed_tokens (drafts included)
    num_draft_tokens: int = 0  # of those, the last ones are ``seq.draft_token_ids`` to verify


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_prefill_tokens_while_decoding: int | None = None,
        prefill_tokens_per_decode: int = 0,
    ) -> None:
        """``max_prefill_tokens_while_decoding``: prefill tokens a step may carry when at least
        one running sequence decodes in it (None: no cap beyond ``max_num_batched_tokens``),
        raised to ``prefill_tokens_per_decode`` x the step's decodes when that is more.
        Raises ``ValueError`` when the cap is below 1 or the per-decode share below 0."""
        if max_prefill_tokens_while_decoding is not None and max_prefill_tokens_while_decoding < 1:
            raise ValueError(f"max_prefill_tokens_while_decoding must be >= 1, got {max_prefill_tokens_while_decoding}")
        if prefill_tokens_per_decode < 0:
            raise ValueError(f"prefill_tokens_per_decode must be >= 0, got {prefill_tokens_per_decode}")
        self.prefill_tokens_per_decode = prefill_tokens_per_decode
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_tokens_while_decoding = max_prefill_tokens_while_decoding
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_decoding(self) -> bool:
        """Whether a running request is past its prompt (its next step is a decode)."""
        return any(seq.num_tokens - seq.num_computed_tokens == 1 for seq in self.running)

    def num_decoding(self) -> int:
        """Running requests past their prompt (each one's next step is a decode)."""
        return sum(seq.num_tokens - seq.num_computed_tokens == 1 for seq in self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a running or waiting sequence and free its blocks (module blocks included)."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.release_context(seq)
        seq.status = SequenceStatus.FINISHED

    def schedule(self) -> list[ScheduledChunk]:
        """Plan one step: decodes first (running order), then the running prefills, then
        admissions from the queue, all under ``max_num_batched_tokens``; prefill tokens are
        further capped while any sequence decodes. May preempt (youngest first) when blocks
        run out, and admits (allocating blocks) what fits. The plan lists each sequence once."""
        budget = self.max_num_batched_tokens
        planned: dict[int, int] = {}  # id(seq) -> tokens this step; the plan keeps running order
        prefills: list[Sequence] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted by an older sequence in this loop
                continue
            while not self.kv.grow(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            if seq.num_tokens - seq.num_computed_tokens == 1:
                if budget > 0:
                    planned[id(seq)] = 1
                    budget -= 1
            else:
                prefills.append(seq)
        # Why a separate prefill budget: one step is one forward, so a decode in it waits for
        # every prefill token beside it (a 1,500-token prompt costs ~1 s on 2 CPU cores).
        cap = prefill_cap(self.max_prefill_tokens_while_decoding, self.prefill_tokens_per_decode, len(planned))
        prefill_budget = budget if cap is None or not planned else min(budget, cap)
        for seq in prefills:
            if prefill_budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, prefill_budget)
            planned[id(seq)] = n
            prefill_budget -= n
            budget -= n
        plan = [ScheduledChunk(seq, planned[id(seq)]) for seq in self.running if id(seq) in planned]
        while self.waiting and prefill_budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.context is not None and not seq.context.admissible:
                break  # the engine acquires its context KV again first
            # Counted once: a sequence preempted mid-prefill finds its own blocks on return.
            if not self.kv.admit(seq, first_time=not seq.admitted_before):
                break
            seq.admitted_before = True
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, prefill_budget)
            plan.append(ScheduledChunk(seq, n))
            prefill_budget -= n
            budget -= n
        self._add_drafts(plan, budget)
        return plan

    def _add_drafts(self, plan: list[ScheduledChunk], budget: int) -> None:
        """Turn the planned one-token decodes of sequences with a draft into verifications,
        in plan order, while the budget and the free blocks left after every other chunk
        allow: a draft never preempts, delays or shrinks anyone else's work. A draft that
        does not fit is dropped (the decode runs as it would without speculation)."""
        for i, item in enumerate(plan):
            seq = item.seq
            draft = seq.draft_token_ids
            if not draft:
                continue
            if (
                item.num_new_tokens == 1
                and seq.num_tokens - seq.num_computed_tokens == 1
                and budget >= len(draft)
                and self.kv.grow(seq, len(draft))
            ):
                plan[i] = ScheduledChunk(seq, 1 + len(draft), len(draft))
                budget -= len(draft)
            else:
                draft.clear()

    def _preempt(self, seq: Sequence) -> None:
        seq.draft_token_ids.clear()
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
