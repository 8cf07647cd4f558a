"""What the PML module cache needs from the engine's model runner: the ``KVAccess`` protocol.

The module cache works with keys, blocks and the store; the KV itself is the runner's, which
runs the precompute forward and copies KV between the store's tensors and pool slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["ModuleKV", "KVAccess"]

ModuleKV = Any  # one module's KV [layers, 2, tokens, kv_heads, head_dim]: the runner's and the store's, opaque here


class KVAccess(Protocol):
    """What the module cache needs from the engine's runner (``ModelRunner`` has these methods)."""

    def precompute_chunk(
        self, token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int], start: int, end: int
    ) -> None:
        """Tokens ``start..end`` of one causal pass writing token ``i``'s KV to ``slots[i]``
        (no logits), attending to the keys of tokens ``..start`` already written."""
        ...

    def write_kv(self, slots: Sequence[int], kv: ModuleKV, first_token: int = 0) -> None:
        """Write tokens ``first_token..`` of a stored module's KV into ``slots``."""
        ...

    def read_kv(self, slots: Sequence[int]) -> ModuleKV:
        """A host copy of the KV in ``slots``, in the store's layout."""
        ...
