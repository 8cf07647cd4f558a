"""The model runner's input types: ``SeqChunk`` (one sequence's new tokens in a step and where
their keys lie) and ``KVLayout`` (the KV tensor's shape per token). Values only: no model, no
tensors held (``engine/model_runner.py`` runs them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvreuse.engine.attention import KeyTable

if TYPE_CHECKING:
    from kvreuse.engine.sequence import Sequence as Sequence_


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence to compute in this step.

    ``keys`` says where every key lies: the fixed context (PML modules), then the
    sequence's own tokens through its block table, the last ``len(token_ids)`` of them
    being these new tokens. The new tokens attend to every key before them and causally
    to each other. ``context_positions`` are the RoPE positions of the keys before the new
    tokens, read only by sliding-window layers (``None`` = ``0..len-1``).
    """

    token_ids: list[int]  # [n]
    positions: list[int]  # [n] RoPE positions of the new tokens
    keys: KeyTable
    context_positions: np.ndarray | None  # [num_context] int64
    sample: bool
    # True: a key is visible to a new token iff its position <= the token's (not by order;
    # blend recomputes scattered tokens among keys on both sides of them)
    by_position: bool = False
    num_logits: int = 1  # with sample: logits rows for the last this many new tokens (a verified draft)

    @classmethod
    def from_slots(
        cls,
        token_ids: Sequence[int],
        positions: Sequence[int],
        new_slots: Sequence[int],
        context_slots: Sequence[int],
        context_positions: Sequence[int] | None,
        sample: bool,
    ) -> SeqChunk:
        """A chunk whose keys lie in arbitrary slots (module precompute, tests): the keys
        before the new tokens are fixed context slots, the new tokens a table of one-slot
        blocks."""
        keys = KeyTable(
            np.asarray(context_slots, dtype=np.int64).reshape(-1),
            np.asarray(new_slots, dtype=np.int64).reshape(-1),
            1,
            len(new_slots),
        )
        ctx_pos = None if context_positions is None else np.asarray(context_positions, dtype=np.int64).reshape(-1)
        return cls(list(token_ids), list(positions), keys, ctx_pos, sample)

    @property
    def num_context(self) -> int:
        """Keys before the new tokens."""
        return self.keys.num_keys - len(self.token_ids)

    @property
    def new_slots(self) -> np.ndarray:
        """``[n]`` int64 slots the new tokens' K/V are written to."""
        own = self.keys.num_own
        return self.keys.own_slots(own - len(self.token_ids), own)


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_windows: tuple[int, ...]  # distinct sliding windows used by some layer

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.tensor([], dtype=dtype).element_size()


def chunk_of(seq: Sequence_, num_new: int, num_draft: int, block_size: int) -> SeqChunk:
    """The runner's view of ``seq``'s next ``num_new`` tokens (the last ``num_draft`` of them
    its draft, all with logits): its block table and context arrays as they are (no per-token
    work over the tokens computed before). Reads ``seq``; changes nothing."""
    done = seq.num_computed_tokens
    token_ids = seq.token_ids_between(done, done + num_new - num_draft)
    if num_draft:
        token_ids = token_ids + seq.draft_token_ids
    return SeqChunk(
        token_ids=token_ids,
        positions=seq.positions_between(done, done + num_new).tolist(),
        keys=KeyTable(seq.context_slots, seq.block_table, block_size, done + num_new, seq.context_shifts),
        context_positions=seq.key_positions(done),  # None unless explicit positions (PML) or module context
        sample=done + num_new - num_draft == seq.num_tokens,
        num_logits=1 + num_draft,
    )
