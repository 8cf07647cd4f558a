"""One request's state as it moves through the engine: tokens, blocks, progress."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvreuse.cache.kv_block import KVBlock
from kvreuse.cache.hashing import BlockHash
from kvreuse.engine.context import PromptContext
from kvreuse.engine.logprobs import TokenLogprobs
from kvreuse.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvreuse.cache.retention import KvCacheRetentionConfig


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable request state, owned by the engine thread.

    Token index ``i`` (prompt then output) lives in KV slot ``slot(i)`` and has RoPE
    position ``position(i)``. ``context`` is read-only KV assembled in front of the
    sequence's own tokens (PML modules); it is not part of ``token_ids``.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    retention: KvCacheRetentionConfig | None = None  # applied by the cache manager; None: defaults
    arrival_time: float = field(default_factory=time.perf_counter)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    blocks: list[KVBlock] = field(default_factory=list)  # own blocks, in token order
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
    generator: object | None = None  # torch.Generator when params.seed is set
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # when params.logprobs is set

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
    def num_context_tokens(self) -> int:
        """Keys assembled in front of the sequence's own tokens (0 without a context)."""
        return 0 if self.context is None else self.context.num_tokens

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

    def slot(self, i: int, block_size: int) -> int:
        return self.blocks[i // block_size].block_id * block_size + i % block_size
