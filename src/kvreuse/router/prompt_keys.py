"""A request body -> the block keys the executor will compute for it.

The router tokenizes exactly as the executor does (``completions``: ``tokenizer.encode``
of the first prompt; ``chat``: the executor's own ``render_chat`` with the model's chat
template) and hashes with ``kvreuse.hashing.hash_token_blocks`` under the executors'
model identity, block size, algorithm and the request's ``cache_salt``. The keys are
returned in index form (``index_key``).

Hashing a 32k-token prompt costs ~30 ms of SHA-256, so keys of block chains seen before
are memoised: ``(parent key, block tokens) -> key``. The walk stops at the first block not
in the memo and hashes the rest in one ``hash_token_blocks(..., parent=...)`` call, so
the memo never changes a key, only how often it is computed. The memo is shared by the
threads the router hashes in (``asyncio.to_thread``), so it is read and updated under a
lock; the hashing itself runs outside it.

A body the router cannot parse or hash (e.g. token ids outside the 64-bit range) gets no
keys: it is routed by load, and the executor answers it (with its own 400 if it is
malformed).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvreuse.cache.hashing import BlockHash, hash_token_blocks
from kvreuse.router.index import IndexKey, index_key


@dataclass(frozen=True, slots=True)
class HashSettings:
    """What every executor behind one router must share for its keys to mean anything."""

    model_id: str
    block_size: int
    hash_algorithm: str


@dataclass(frozen=True, slots=True)
class RequestKeys:
    num_tokens: int  # prompt tokens (0 when the body could not be tokenized)
    keys: list[IndexKey]  # index keys of the prompt's full blocks


class PromptHasher:
    """Tokenizes request bodies and computes their block keys. ``memo_blocks`` bounds the
    memo (oldest entries go first). Thread-safe: ``request_keys`` may run in several
    threads at once."""

    def __init__(self, tokenizer: Any, settings: HashSettings, *, memo_blocks: int = 1_000_000) -> None:
        self.tokenizer = tokenizer
        self.settings = settings
        self.memo_blocks = memo_blocks
        self._memo: dict[tuple, BlockHash] = {}
        self._memo_lock = threading.Lock()  # to_thread callers share the memo

    # ------------------------------------------------------------------ tokens
    def completion_tokens(self, body: dict) -> list[int] | None:
        from kvreuse.api.errors import APIError
        from kvreuse.api.protocol import CompletionRequest

        try:
            prompts = CompletionRequest.model_validate(body).prompts()
        except (ValueError, APIError):
            return None
        first = prompts[0]
        return list(self.tokenizer.encode(first)) if isinstance(first, str) else list(first)

    def chat_tokens(self, body: dict) -> list[int] | None:
        from kvreuse.api.chat_prompt import render_chat
        from kvreuse.api.errors import APIError
        from kvreuse.api.protocol import ChatCompletionRequest

        try:
            req = ChatCompletionRequest.model_validate(body)
            prompt = render_chat(
                self.tokenizer,
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                template_kwargs=req.chat_template_kwargs,
            )
        except (ValueError, APIError):
            return None
        return prompt.token_ids

    def request_keys(self, chat: bool, body: dict) -> RequestKeys:
        """Keys of a completions (``chat=False``) or chat body; no keys (``RequestKeys(0, [])``)
        if it cannot be parsed or its token ids cannot be hashed (outside the signed 64-bit
        range): such a request is routed by load and the executor answers it."""
        tokens = self.chat_tokens(body) if chat else self.completion_tokens(body)
        if tokens is None:
            return RequestKeys(0, [])
        salt = body.get("cache_salt")
        try:
            keys = self.keys(tokens, salt if isinstance(salt, str) and salt else None)
        except (struct.error, OverflowError):
            return RequestKeys(0, [])  # hash_block packs ids as int64; the executor refuses them with a 400
        return RequestKeys(len(tokens), keys)

    # ------------------------------------------------------------------ keys
    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[BlockHash]:
        """Full block hashes, exactly ``hash_token_blocks(token_ids, ...)``."""
        s, bs = self.settings, self.settings.block_size
        memo = self._memo
        out: list[BlockHash] = []
        parent: BlockHash | None = None
        n_full = len(token_ids) // bs
        with self._memo_lock:
            for i in range(n_full):
                block = tuple(token_ids[i * bs : (i + 1) * bs])
                key = memo.get((parent if i else ("root", cache_salt), block))
                if key is None:
                    break
                out.append(key)
                parent = key
        start = len(out)
        if start == n_full:
            return out
        rest = hash_token_blocks(
            token_ids[start * bs : n_full * bs],
            bs,
            model_id=s.model_id,
            cache_salt=cache_salt,
            algorithm=s.hash_algorithm,
            parent=parent,
        )
        with self._memo_lock:
            for j, key in enumerate(rest, start):
                memo[(parent if j else ("root", cache_salt), tuple(token_ids[j * bs : (j + 1) * bs]))] = key
                parent = key
            while len(memo) > self.memo_blocks:
                del memo[next(iter(memo))]
        out.extend(rest)
        return out

    def keys(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[IndexKey]:
        return [index_key(h) for h in self.block_hashes(token_ids, cache_salt)]
