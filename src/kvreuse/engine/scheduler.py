"""Continuous batching: every step mixes decodes and (chunks of) prefills under a token
budget; waiting requests are admitted first-come first-served when their blocks fit.

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


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    num_new_tokens: int  # tokens computed for ``seq`` this step, from its num_computed_tokens (drafts included)
    num_draft_tokens: int = 0  # of those, the last ones are ``seq.draft_token_ids`` to verify


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
        budget = self.max_num_batched_tokens
        plan: list[ScheduledChunk] = []
        for seq in list(self.running):
            if seq not in self.running:  # preempted by an older sequence in this loop
                continue
            while not self.kv.grow(seq):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq not in self.running or budget == 0:
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            plan.append(ScheduledChunk(seq, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
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
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            plan.append(ScheduledChunk(seq, n))
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
            if (item.num_new_tokens == 1 and seq.num_tokens - seq.num_computed_tokens == 1
                    and budget >= len(draft) and self.kv.grow(seq, len(draft))):
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
