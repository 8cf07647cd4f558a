"""What a request must satisfy before the engine queues it (one place for every refusal)."""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from kvreuse.sampling_params import SamplingParams


def check_request(
    request_id: str,
    prompt_token_ids: list[int],
    params: SamplingParams,
    prompt_positions: list[int] | None,
    *,
    in_use: Container[str],
    max_model_len: int,
    vocab_size: int,
    pool_blocks: int,
    blocks_needed: Callable[[int], int],
    context_blocks: tuple[int, int] = (0, 0),
) -> None:
    """Refuse a request the engine could never run, before anything is allocated: a reused id,
    an empty prompt, one that (with ``max_tokens``) overflows the model's context, token ids
    outside the vocabulary, or more KV blocks than the pool's ``pool_blocks`` (``blocks_needed``:
    blocks for a token count; ``context_blocks``: the context's blocks held beside the request's
    own, and an acquisition's peak). Pure: changes nothing. Raises ValueError naming the field or
    setting to change."""
    if request_id in in_use:
        raise ValueError(f"request id {request_id!r} is already in use")
    # With explicit positions (PML) the context used is the highest position + 1.
    n = len(prompt_token_ids) if not prompt_positions else max(prompt_positions) + 1
    if n == 0:
        raise ValueError("prompt is empty: it must contain at least one token")
    if n >= max_model_len:
        raise ValueError(
            f"prompt has {n} tokens but the model's context is {max_model_len} tokens "
            "(shorten the prompt or start the server with a larger --max-model-len)"
        )
    if n + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens={params.max_tokens} plus the prompt's {n} tokens exceeds the model's context of "
            f"{max_model_len} tokens: lower max_tokens to at most {max_model_len - n}"
        )
    vocab = vocab_size
    if any(not 0 <= t < vocab for t in prompt_token_ids):
        raise ValueError(f"prompt contains token ids outside the vocabulary [0, {vocab})")
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids: ids must be in the vocabulary [0, {vocab}) (one could never match)")
    # the last sampled token is never fed back, so it needs no slot
    # the context's blocks once held beside the request's own, or an acquisition's peak
    held = blocks_needed(len(prompt_token_ids) + params.max_tokens - 1) + context_blocks[0]
    if context_blocks[1] > pool_blocks:
        # the peak of acquiring the context (modules recomputed into scratch) alone is too big:
        # no max_tokens can help, however many blocks it asks for beside the context
        raise ValueError(
            f"the request's context needs {context_blocks[1]} KV blocks at once while its modules or documents are "
            f"computed, but the pool has {pool_blocks}: use fewer or shorter modules/documents or raise "
            "--kv-cache-memory"
        )
    if held > pool_blocks:
        raise ValueError(
            f"the request needs {held} KV blocks (prompt {n} + max_tokens {params.max_tokens}) but the pool "
            f"has {pool_blocks}: lower max_tokens or raise --kv-cache-memory"
        )


def check_documents(
    documents: Sequence[Sequence[int]], num_tokens: int, max_tokens: int, *, vocab_size: int, max_model_len: int | None
) -> None:
    """Refuse a documents prompt (``DocumentPrompt``) the engine could never run: a document
    with token ids outside the vocabulary, or a prompt of ``num_tokens`` that with
    ``max_tokens`` overflows the context. Pure. Raises ValueError naming the part to change."""
    for i, piece in enumerate(documents):
        if any(not 0 <= t < vocab_size for t in piece):
            raise ValueError(f"documents: part {i} holds token ids outside the vocabulary [0, {vocab_size})")
    if max_model_len is not None and num_tokens + max_tokens > max_model_len:
        raise ValueError(
            f"documents: the prompt ({num_tokens} tokens) + max_tokens ({max_tokens}) "
            f"exceeds the context length {max_model_len}; shorten it or lower max_tokens"
        )
