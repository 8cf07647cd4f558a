"""Paged attention for transformers models: reads and writes the block pool's KV storage.

Registered with transformers' ``AttentionInterface`` under the name ``"kvreuse"``; the
model then calls ``paged_attention`` in every layer with the new tokens' q/k/v (RoPE
already applied). We write the new k/v into their pool slots and attend over each
sequence's keys, found through its block table (``KeyTable``): read in place as runs of
consecutive slots, or gathered by index. The pool is the only KV storage, there is no
per-request cache object. No transformers mask function is registered for the
name, so the model builds no mask and we build our own from the batch description.

The batch is flattened to ``[1, T]`` (all sequences' new tokens back to back). Prefill
chunks are attended one sequence at a time; single-token decodes over short contexts are
padded and batched (the runner sends decodes over long contexts as one-token prefill items,
which read the pool in place).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvreuse.cache.kv_block import cdiv

ATTN_NAME = "kvreuse"


@dataclass(frozen=True)
class KeyTable:
    """Where one sequence's keys lie in the pool, in attention order: ``context_slots``
    (fixed slots, e.g. PML modules), then ``num_own`` own tokens, token ``t`` in slot
    ``block_ids[t // block_size] * block_size + t % block_size``.

    Slots and runs come from array arithmetic over the table, never a loop per token. The
    arrays are the sequence's own (views): valid for the step they were taken in.
    """

    context_slots: np.ndarray  # [c] int64
    block_ids: np.ndarray  # [>= ceil(num_own / block_size)] int64, own blocks in token order
    block_size: int
    num_own: int  # own tokens that are keys (those computed before, then the new ones)

    @property
    def num_keys(self) -> int:
        return len(self.context_slots) + self.num_own

    def own_slots(self, start: int, end: int) -> np.ndarray:
        """Slots of own tokens ``start..end-1``: ``[end - start]`` int64."""
        bs = self.block_size
        first, last = start // bs, cdiv(end, bs)
        slots = (self.block_ids[first:last, None] * bs + np.arange(bs)).reshape(-1)  # [(last - first) * bs]
        return slots[start - first * bs : end - first * bs]

    def own_intervals(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        """Own tokens ``start..end-1`` as one interval of consecutive slots per block:
        ``(first slots, lengths)``, each ``[blocks touched]`` int64."""
        bs = self.block_size
        if end <= start:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        first, last = start // bs, cdiv(end, bs)
        base = np.arange(first, last) * bs  # [m] index of each block's first token
        lo = np.maximum(start - base, 0)  # [m] first offset used in each block
        hi = np.minimum(end - base, bs)  # [m] one past the last
        return self.block_ids[first:last] * bs + lo, hi - lo

    def slots(self) -> np.ndarray:
        """Every key's slot, in attention order: ``[num_keys]`` int64."""
        return np.concatenate((self.context_slots, self.own_slots(0, self.num_own)))


@dataclass
class PrefillItem:
    """One sequence's new tokens attended one sequence at a time. The keys are read in
    place as ``kv_runs`` when there are few runs and the query is short, else gathered
    through ``kv_slots`` (built from the table the first time a layer asks)."""

    start: int  # first index of this sequence's new tokens in the flattened batch
    num_new: int
    keys: KeyTable  # every key (context + new), the new tokens last
    mask_full: torch.Tensor | None  # [num_new, L] bool, None = plain causal over new tokens only
    mask_sliding: dict[int, torch.Tensor | None]  # window -> [num_new, L] bool
    kv_runs: tuple[tuple[int, int], ...] = ()  # (first slot, length) runs covering the keys, if few
    device: torch.device | str = "cpu"  # where kv_slots is wanted (the pool's device)

    @cached_property
    def kv_slots(self) -> torch.Tensor:
        """``[L]`` slots of every key (context + new), in attention order."""
        return torch.from_numpy(self.keys.slots()).to(self.device)  # [L]


@dataclass
class DecodeBatch:
    token_index: torch.Tensor  # [B] index of each decode token in the flattened batch
    kv_slots: torch.Tensor  # [B, Lmax] slots (from each row's block table), padded with 0
    mask_full: torch.Tensor  # [B, 1, 1, Lmax] bool
    mask_sliding: dict[int, torch.Tensor]  # window -> [B, 1, 1, Lmax] bool


@dataclass
class ForwardContext:
    """What every layer needs to place and read KV for one forward pass."""

    kv_cache: torch.Tensor  # [layers, 2, kv_heads, num_slots, head_dim]
    slot_mapping: torch.Tensor  # [T] where each new token's k/v is written
    prefills: list[PrefillItem]
    decodes: DecodeBatch | None


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,  # [1, kv_heads, T, head_dim]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    kv_context: ForwardContext | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over the pool. Returns ``[1, T, heads, head_dim]`` as transformers expects."""
    if kv_context is None:
        # A plain forward of the same model object (a reference run, a baseline): behave
        # exactly like transformers' SDPA attention so sharing the model is harmless. No
        # mask was built for our implementation name: make the causal (+ window) one here.
        if attention_mask is None and sliding_window and key.shape[2] > sliding_window:
            q_pos = torch.arange(key.shape[2] - query.shape[2], key.shape[2], device=query.device)[:, None]
            k_pos = torch.arange(key.shape[2], device=query.device)[None, :]
            attention_mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)  # [q, k]
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
            sliding_window=sliding_window, **kwargs,
        )
    ctx = kv_context
    layer_cache = ctx.kv_cache[module.layer_idx]  # [2, kv_heads, num_slots, head_dim]
    k_cache, v_cache = layer_cache[0], layer_cache[1]
    k_cache.index_copy_(1, ctx.slot_mapping, key[0])  # key[0]: [kv_heads, T, head_dim]
    v_cache.index_copy_(1, ctx.slot_mapping, value[0])

    out = torch.empty_like(query.transpose(1, 2))  # [1, T, heads, head_dim]
    for item in ctx.prefills:
        q = query[:, :, item.start : item.start + item.num_new]  # [1, heads, n, d]
        mask = item.mask_sliding.get(sliding_window) if sliding_window else item.mask_full
        if item.mask_full is None and mask is None:
            # Fresh prompt, no context: the same causal SDPA call plain transformers makes.
            k = key[:, :, item.start : item.start + item.num_new]
            v = value[:, :, item.start : item.start + item.num_new]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
        elif item.num_new <= SMALL_QUERY and item.kv_runs:
            # the keys lie in a few runs of consecutive slots: read them in place, no gather
            ks = [k_cache[:, a : a + n] for a, n in item.kv_runs]  # views [kv_heads, n_i, d]
            vs = [v_cache[:, a : a + n] for a, n in item.kv_runs]
            o = _grouped_attention(q[0], ks, vs, mask if sliding_window else None, scaling).unsqueeze(0)
        else:
            k = k_cache.index_select(1, item.kv_slots)  # [kv_heads, L, d]
            v = v_cache.index_select(1, item.kv_slots)
            if item.num_new <= SMALL_QUERY:
                # full-attention layers: every context key is visible, only the new tokens are causal
                o = _grouped_attention(q[0], [k], [v], mask if sliding_window else None, scaling).unsqueeze(0)
            else:
                o = F.scaled_dot_product_attention(
                    q, k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scaling, enable_gqa=True
                )
        out[:, item.start : item.start + item.num_new] = o.transpose(1, 2)
    if ctx.decodes is not None:
        d = ctx.decodes
        b, lmax = d.kv_slots.shape
        q = query[0, :, d.token_index].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, d]
        flat = d.kv_slots.reshape(-1)
        kv_heads, head_dim = k_cache.shape[0], k_cache.shape[2]
        k = k_cache.index_select(1, flat).view(kv_heads, b, lmax, head_dim).transpose(0, 1)  # [B, kv_heads, Lmax, d]
        v = v_cache.index_select(1, flat).view(kv_heads, b, lmax, head_dim).transpose(0, 1)
        mask = d.mask_sliding[sliding_window] if sliding_window else d.mask_full
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[0, d.token_index] = o.squeeze(2)  # [B, heads, d]
    return out, None


SMALL_QUERY = 128  # below this many new tokens, plain matmuls beat the flash kernel on CPU


def _grouped_attention(
    q: torch.Tensor,  # [heads, n, d]
    ks: list[torch.Tensor],  # pieces of the keys in attention order, each [kv_heads, L_i, d]
    vs: list[torch.Tensor],  # matching values, each [kv_heads, L_i, d]
    mask: torch.Tensor | None,  # [n, L] bool (True = attend); None = context all visible, new tokens causal
    scale: float | None,
) -> torch.Tensor:
    """Attention of a few queries over a long context, as batched matmuls per KV head group
    (no K/V repetition for GQA); the keys may come in pieces (views into the pool).
    Returns ``[heads, n, d]``.

    For a short query (a 32-token suffix after a cached 4k prefix) this avoids the flash
    kernel, which is tuned for long queries, and the copy of the whole context."""
    heads, n, d = q.shape
    kv_heads = ks[0].shape[0]
    groups = heads // kv_heads
    scale = d**-0.5 if scale is None else scale
    # Scale the few queries, not the long score rows: one pass over [kv, g*n, L] saved.
    qg = (q * scale).reshape(kv_heads, groups * n, d)  # head h uses kv head h // groups, as repeat_kv does
    length = sum(k.shape[1] for k in ks)
    # Each piece's scores land in their columns directly (bmm into a view): no concatenation.
    scores = torch.empty(kv_heads, groups * n, length, dtype=q.dtype, device=q.device)  # [kv, g*n, L]
    offset = 0
    for k in ks:
        torch.bmm(qg, k.transpose(1, 2), out=scores[..., offset : offset + k.shape[1]])
        offset += k.shape[1]
    grouped = scores.view(kv_heads, groups, n, length)  # [kv, g, n, L]
    if mask is None:
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)  # [n, n] True = not yet
        grouped[..., length - n :].masked_fill_(future, float("-inf"))
    else:
        grouped.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [kv, g*n, L]
    out = None
    offset = 0
    for v in vs:
        piece = torch.bmm(probs[..., offset : offset + v.shape[1]], v)  # [kv_heads, groups*n, d]
        out = piece if out is None else out.add_(piece)
        offset += v.shape[1]
    return out.view(heads, n, d)


def register() -> str:
    """Make ``paged_attention`` available as ``attn_implementation="kvreuse"``. Idempotent."""
    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
