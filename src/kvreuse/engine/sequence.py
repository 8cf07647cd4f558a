"""One request's state as it moves through the engine: tokens, blocks, progress."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvreuse.cache.hashing import BlockHash
from kvreuse.cache.kv_block import KVBlock
from kvreuse.cache.retention import KvCacheRetentionConfig
from kvreuse.engine.context import PromptContext
from kvreuse.engine.logprobs import TokenLogprobs
from kvreuse.engine.spec_decode import SpecState
from kvreuse.sampling_params import SamplingParams

if TYPE_CHECKING:  # a sequence imports no torch (the simulators build sequences without it)
    import torch


_EMPTY = np.zeros(0, np.int64)  # [0] no module context
_EMPTY.flags.writeable = False


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable request state, owned by the engine thread.

    Token index ``i`` (prompt then output) lives in KV slot ``block_table[i // bs] * bs +
    i % bs`` and has RoPE position ``position(i)``. ``blocks`` is read-only: the cache
    manager changes it through ``append_blocks`` / ``replace_block`` / ``clear_blocks``,
    which keep ``block_table`` (the block ids as an array, grown a block at a time) in
    step. ``context`` is read-only KV assembled in front of the sequence's own tokens (PML
    modules), one ``PromptContext`` handle; it is not part of ``token_ids``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    retention: KvCacheRetentionConfig | None = None  # applied by the cache manager; None: defaults
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_hashes: list[BlockHash] = field(default_factory=list)  # keys of full blocks so far
    num_registered_blocks: int = 0  # leading own blocks already entered in the prefix index
    num_computed_tokens: int = 0  # tokens whose KV is in the pool (hits included)
    num_cached_tokens: int = 0  # prompt tokens served from the cache at admission
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)  # of those, per tier (GPU, CPU, DISK, REMOTE)
    admitted_before: bool = False  # a preempted sequence re-admitted: its own blocks are no cache hits
    prompt_positions: list[int] | None = None  # explicit RoPE positions (e.g. PML); None = index
    context: PromptContext | None = None  # read-only KV in front of the prompt; None: none
    first_token_time: float | None = None
    finish_reason: str | None = None
    text: str = ""  # detokenized output so far (stop strings cut)
    generator: torch.Generator | None = None  # when params.seed is set
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when params.logprobs is set
    # Prompt lookup: tokens proposed for verification this step (not part of token_ids; their
    # slots follow the last token's; the scheduler may drop them, the engine clears them after
    # the step) and the request's speculation state (None: it never speculates).
    draft_token_ids: list[int] = field(default_factory=list)
    spec: SpecState | None = None
    _blocks: tuple[KVBlock, ...] = field(default=(), init=False, repr=False)  # own blocks, in token order
    _block_ids: np.ndarray = field(default_factory=lambda: np.zeros(8, np.int64), init=False, repr=False)  # [capacity]
    _key_positions: np.ndarray | None = field(default=None, init=False, repr=False)  # [capacity] context + own
    _num_key_positions: int = field(default=0, init=False, repr=False)  # valid leading entries of _key_positions
    _key_context: object = field(
        default=None, init=False, repr=False
    )  # the context positions _key_positions starts with
    _prompt_position_array: np.ndarray | None = field(default=None, init=False, repr=False)  # [prompt] int64

    def __post_init__(self) -> None:
        if self.prompt_positions is not None:
            self._prompt_position_array = np.asarray(self.prompt_positions, dtype=np.int64)  # [prompt], built once

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    def position(self, i: int) -> int:
        """RoPE position of token index ``i``; generated tokens follow the last prompt one."""
        if self.prompt_positions is None:
            return i
        if i < len(self.prompt_positions):
            return self.prompt_positions[i]
        return self.prompt_positions[-1] + 1 + (i - len(self.prompt_positions))

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``token_ids[start:end]`` without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def positions_between(self, start: int, end: int) -> np.ndarray:
        """RoPE positions of token indices ``start..end-1``: ``[end - start]`` int64."""
        if self._prompt_position_array is None:
            return np.arange(start, end, dtype=np.int64)
        prompt = self._prompt_position_array
        p = len(prompt)
        if end <= p:
            return prompt[start:end]
        generated = prompt[-1] + 1 + np.arange(max(start, p) - p, end - p, dtype=np.int64)  # [end - max(start, p)]
        return generated if start >= p else np.concatenate((prompt[start:], generated))

    # ------------------------------------------------------------------ blocks
    @property
    def blocks(self) -> tuple[KVBlock, ...]:
        """Own blocks, in token order (read-only; see the class docstring)."""
        return self._blocks

    @property
    def block_table(self) -> np.ndarray:
        """``[len(blocks)]`` int64 ids of ``blocks``: a view, valid until the blocks change."""
        return self._block_ids[: len(self._blocks)]

    def append_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Add blocks at the end (the table grows in place, doubling when full)."""
        new = tuple(blocks)
        n, total = len(self._blocks), len(self._blocks) + len(new)
        if total > len(self._block_ids):
            grown = np.zeros(max(total, 2 * len(self._block_ids)), np.int64)  # [capacity]
            grown[:n] = self._block_ids[:n]
            self._block_ids = grown
        self._block_ids[n:total] = [b.block_id for b in new]
        self._blocks += new

    def replace_block(self, index: int, block: KVBlock) -> None:
        """Put ``block`` in place of block ``index`` (a shared copy of the same tokens)."""
        self._blocks = self._blocks[:index] + (block,) + self._blocks[index + 1 :]
        self._block_ids[index] = block.block_id

    def drop_tail_blocks(self, keep: int) -> tuple[KVBlock, ...]:
        """Remove the blocks after the first ``keep`` and return them (the caller releases them)."""
        dropped = self._blocks[keep:]
        self._blocks = self._blocks[:keep]
        return dropped

    def clear_blocks(self) -> None:
        self._blocks = ()

    # ------------------------------------------------------------------ context
    @property
    def num_context_tokens(self) -> int:
        """Keys assembled in front of the sequence's own tokens (0 without a context)."""
        return 0 if self.context is None else self.context.num_tokens

    @property
    def context_slots(self) -> np.ndarray:
        """``[c]`` int64 slots of the context keys now held (empty: none, or released)."""
        return _EMPTY if self.context is None else self.context.slot_array

    @property
    def context_shifts(self) -> np.ndarray | None:
        """``[c]`` int64 RoPE positions each context key stands away from where its K was
        computed (documents read in place); ``None`` when every key is where it was computed."""
        return None if self.context is None else self.context.shift_array

    @property
    def context_positions(self) -> np.ndarray:
        """``[c]`` int64 RoPE positions of those keys."""
        return _EMPTY if self.context is None else self.context.position_array

    def key_positions(self, num_own: int) -> np.ndarray | None:
        """RoPE positions of every key up to own token ``num_own``, context first: ``[c +
        num_own]`` int64, a view of an array kept across steps (extended, never rebuilt);
        ``None`` when they are just ``0..num_own-1`` (no context, no explicit positions)."""
        context = self.context_positions
        if self._prompt_position_array is None and not len(context):
            return None
        if context is not self._key_context:  # the context was (re)acquired or released: start over
            self._key_positions, self._num_key_positions, self._key_context = None, 0, context
        c = len(context)
        wanted = c + num_own
        if self._key_positions is None:
            self._key_positions = np.zeros(max(wanted, 64), np.int64)  # [capacity]
            self._key_positions[:c] = context
            self._num_key_positions = c
        if wanted > self._num_key_positions:
            if wanted > len(self._key_positions):
                grown = np.zeros(max(wanted, 2 * len(self._key_positions)), np.int64)  # [capacity]
                grown[: self._num_key_positions] = self._key_positions[: self._num_key_positions]
                self._key_positions = grown
            have = self._num_key_positions - c
            self._key_positions[self._num_key_positions : wanted] = self.positions_between(have, num_own)
            self._num_key_positions = wanted
        return self._key_positions[:wanted]
