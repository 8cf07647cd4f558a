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

from typing import cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvreuse.engine import invariant_attention
from kvreuse.engine.flash import attend_alone, flash, merge
from kvreuse.engine.forward_batch import DecodeBatch, ForwardContext, KeyTable, PrefillItem  # also exported here
from kvreuse.engine.key_frames import KeyFrames
from kvreuse.engine.kv_quant import KVSide, layer_sides

__all__ = [
    "ATTN_NAME",
    "paged_attention",
    "attend",
    "register",
    "KeyTable",
    "PrefillItem",
    "DecodeBatch",
    "ForwardContext",
]

ATTN_NAME = "kvreuse"


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
    """Attention over the pool, as transformers' ``AttentionInterface`` calls it. Returns
    ``[1, T, heads, head_dim]`` as transformers expects."""
    if kv_context is None:
        # A plain forward of the same model object (a reference run, a baseline): behave
        # exactly like transformers' SDPA attention so sharing the model is harmless. No
        # mask was built for our implementation name: make the causal (+ window) one here.
        if attention_mask is None and sliding_window and key.shape[2] > sliding_window:
            q_pos = torch.arange(key.shape[2] - query.shape[2], key.shape[2], device=query.device)[:, None]
            k_pos = torch.arange(key.shape[2], device=query.device)[None, :]
            attention_mask = (k_pos <= q_pos) & (k_pos > q_pos - sliding_window)  # [q, k]
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling=scaling,
            dropout=dropout,
            sliding_window=sliding_window,
            **kwargs,
        )
    layer_idx = cast("int", module.layer_idx)  # transformers' attention modules carry their layer index
    out = attend(
        layer_idx,
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        kv_context,
        scaling,
        sliding_window,
    )  # [T, heads, d]
    return out.unsqueeze(0), None


def attend(
    layer_idx: int,
    query: torch.Tensor,  # [T, heads, head_dim], RoPE applied
    key: torch.Tensor,  # [T, kv_heads, head_dim], RoPE applied
    value: torch.Tensor,  # [T, kv_heads, head_dim]
    ctx: ForwardContext,
    scale: float | None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Write the new tokens' K/V into their pool slots, then attend every item of ``ctx`` over
    its keys. Returns ``[T, heads, head_dim]``.

    One call per layer: the per-item work is a kernel call or two (``_flash_over_pool``);
    score rows are never materialised except on sliding-window layers, which keep the masked
    path (their windows cut the context, which the fused path does not model)."""
    k_cache, v_cache = layer_sides(ctx.kv_cache, layer_idx)  # each [kv_heads, num_slots, d] as read
    # the new tokens attend to their K/V as the pool gives them back (int8: quantized once, here)
    key = k_cache.write(ctx.slot_mapping, key.transpose(0, 1)).transpose(0, 1)  # [T, kv_heads, d]
    value = v_cache.write(ctx.slot_mapping, value.transpose(0, 1)).transpose(0, 1)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    t = query.shape[0]
    if len(ctx.prefills) == 1 and ctx.decodes is None and ctx.prefills[0].num_new == t:
        return _attend_item(
            ctx.prefills[0], query, key, value, k_cache, v_cache, scale, sliding_window, layer_idx, ctx.invariant
        )
    out = torch.empty_like(query)  # [T, heads, d]
    for item in ctx.prefills:
        span = slice(item.start, item.start + item.num_new)
        out[span] = _attend_item(
            item, query[span], key[span], value[span], k_cache, v_cache, scale, sliding_window, layer_idx, ctx.invariant
        )
    if ctx.decodes is not None:
        d = ctx.decodes
        b, lmax = d.kv_slots.shape
        q = query[d.token_index].unsqueeze(2)  # [B, heads, 1, d]
        flat = d.kv_slots.reshape(-1)
        kv_heads, head_dim = k_cache.kv_heads, query.shape[-1]
        k = k_cache.select(flat).view(kv_heads, b, lmax, head_dim).transpose(0, 1)  # [B, kv_heads, Lmax, d]
        v = v_cache.select(flat).view(kv_heads, b, lmax, head_dim).transpose(0, 1)
        mask = d.mask_sliding[sliding_window] if sliding_window else d.mask_full
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[d.token_index] = o.squeeze(2)  # [B, heads, d]
    return out


def _attend_item(
    item: PrefillItem,
    q: torch.Tensor,  # [n, heads, d]
    k: torch.Tensor,  # [n, kv_heads, d] the new tokens' keys
    v: torch.Tensor,  # [n, kv_heads, d]
    k_cache: KVSide,  # [kv_heads, num_slots, d] as read
    v_cache: KVSide,
    scale: float,
    sliding_window: int | None,
    layer: int = 0,
    invariant: bool = False,
) -> torch.Tensor:
    """One sequence's new tokens over its keys: ``[n, heads, d]``. ``invariant``: a plain item
    (keys in one frame, causal by order, full attention) through the batch-invariant kernel;
    documents' frames and seam repair's masks keep their paths (their reuse is approximate)."""
    if invariant and item.frames is None and not item.masked and not sliding_window:
        # every key in attention order, the new ones last: one run as a view, else the pool side
        # read by slot (the kernel reads rows in place; the torch path gathers). An int8 pool's
        # rows as stored: the kernel reads them, the torch path dequantizes.
        if len(item.kv_runs) == 1:
            ((a, length),) = item.kv_runs
            kk, vv = k_cache.stored_run(a, length), v_cache.stored_run(a, length)  # [kv, L, row]
            return invariant_attention.attend(q, kk, vv, scale)
        kk, at = k_cache.stored_at(item.kv_slots)  # the pool side read at ``at``, or gathered (fp8)
        vv, _ = v_cache.stored_at(item.kv_slots)
        return invariant_attention.attend(q, kk, vv, scale, at)
    if item.frames is not None:
        if sliding_window:
            raise RuntimeError(
                "attention: keys in several RoPE frames on a sliding-window layer "
                "(the runner copies such documents instead)"
            )
        return _flash_over_frames(item.frames, layer, q, k, v, k_cache, v_cache, scale)
    mask = item.mask_sliding.get(sliding_window) if sliding_window else item.mask_full
    if item.masked:  # keys by position (seam repair): gather, then the mask decides alone
        kk = k_cache.select(item.kv_slots)[None]  # [1, kv_heads, L, d]
        vv = v_cache.select(item.kv_slots)[None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], kk, vv, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [1, heads, n, d]
        return o[0].transpose(0, 1)
    if item.mask_full is None and mask is None:
        # Fresh prompt, no context: the same causal SDPA call plain transformers makes. 4-D: with
        # 3-D inputs and enable_gqa, CPU SDPA falls back to its math path (bf16, 9 heads over 3,
        # 4,096 tokens: 0.92 s a layer against 0.026 s through the flash kernel).
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )  # [1, heads, n, d]
        return o[0].transpose(0, 1)
    if not sliding_window:
        return _flash_over_pool(item, q, k, v, k_cache, v_cache, scale)
    # Sliding-window layer: the window masks context keys too (attention order, bool mask).
    assert mask is not None  # the batch builds a mask for every sliding window it serves
    qh = q.transpose(0, 1)  # [heads, n, d]
    if item.num_new <= SMALL_QUERY and item.kv_runs:
        # the keys lie in a few runs of consecutive slots: read them in place, no gather
        ks = [k_cache.run(a, n) for a, n in item.kv_runs]  # views [kv_heads, n_i, d]
        vs = [v_cache.run(a, n) for a, n in item.kv_runs]
        return _grouped_attention(qh, ks, vs, mask, scale).transpose(0, 1)
    kk = k_cache.select(item.kv_slots)  # [kv_heads, L, d]
    vv = v_cache.select(item.kv_slots)
    if item.num_new <= SMALL_QUERY:
        return _grouped_attention(qh, [kk], [vv], mask, scale).transpose(0, 1)
    o = F.scaled_dot_product_attention(
        qh.unsqueeze(0), kk.unsqueeze(0), vv.unsqueeze(0), attn_mask=mask, scale=scale, enable_gqa=True
    )  # [1, heads, n, d]
    return o[0].transpose(0, 1)


RUN_TOKENS_IN_PLACE = 512  # a decode reads its runs in place when they average this many keys, else gathers
SMALL_QUERY = 128  # below this many new tokens, plain matmuls beat SDPA's kernel on CPU (sliding-window layers)


def _flash_over_pool(
    item: PrefillItem,
    q: torch.Tensor,  # [n, heads, d]
    k: torch.Tensor,  # [n, kv_heads, d] the new tokens' keys (already in the pool too)
    v: torch.Tensor,  # [n, kv_heads, d]
    k_cache: KVSide,  # [kv_heads, num_slots, d] as read
    v_cache: KVSide,
    scale: float,
) -> torch.Tensor:
    """Full attention of ``n`` new tokens over the context (read in place from the pool) and
    causally over themselves, by a flash kernel that also returns each row's log-sum-exp;
    pieces are merged by their log-sum-exp. Returns ``[n, heads, d]``.

    - ``n == 1`` (a decode): every key is visible, the new one included (written above), so
      each run of the keys is one unmasked call; one run (a sequence's blocks side by side)
      is one call and no merge; short or many runs are gathered into one call. The query heads
      of a KV head are stacked as rows (``[kv_heads, groups, d]``, a view), so the kernel reads
      each key once per KV head.
    - ``n > 1`` (a suffix after a cached prefix, a chunk): the context in one unmasked call
      (in place when it is one run, else gathered once), the new tokens in one causal call
      over their own K/V (square, so causal is unambiguous), merged.
    """
    n, heads, d = q.shape
    kv_heads = k_cache.kv_heads
    if n == 1:
        qg = q.view(1, kv_heads, heads // kv_heads, d)  # [1, kv, groups, d]: head h uses kv head h // groups
        runs = item.kv_runs
        if len(runs) == 1:
            ((a, length),) = runs
            o = attend_alone(qg, k_cache.stored_run(a, length)[None], v_cache.stored_run(a, length)[None], scale)
            return o.view(1, heads, d)
        if runs and item.keys.num_keys >= RUN_TOKENS_IN_PLACE * len(runs):
            # long runs: read each in place (a gather would copy the whole context per layer)
            pieces = [flash(qg, k_cache.run(a, m)[None], v_cache.run(a, m)[None], scale) for a, m in runs]
            return merge(pieces).view(1, heads, d)
        slots = item.kv_slots  # short or many runs: one gather is cheaper than a kernel call per run
        o = attend_alone(qg, k_cache.stored_select(slots)[None], v_cache.stored_select(slots)[None], scale)
        return o.view(1, heads, d)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d] (a view; the kernel takes strides)
    runs = item.context_runs
    if len(runs) == 1:
        ((a, length),) = runs
        kc, vc = k_cache.run(a, length)[None], v_cache.run(a, length)[None]  # views [1, kv, c, d]
    else:
        slots = item.context_slots_tensor
        kc, vc = k_cache.select(slots)[None], v_cache.select(slots)[None]  # [1, kv, c, d]
    # every context key is visible to every new token: stack a KV head's query heads as rows
    # ([1, kv, groups * n, d]), so the kernel reads each context key once per KV head
    groups = heads // kv_heads
    qc = qh.reshape(1, kv_heads, groups * n, d)  # head h = kv head h // groups: rows (group, token)
    out_c, lse_c = flash(qc, kc, vc, scale)
    context = out_c.view(1, heads, n, d), lse_c.reshape(1, heads, n)
    own = flash(qh, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), scale, causal=True)
    return merge([context, own])[0].transpose(0, 1)  # [n, heads, d]


def _flash_over_frames(
    frames: KeyFrames,
    layer: int,
    q: torch.Tensor,  # [n, heads, d]
    k: torch.Tensor,  # [n, kv_heads, d] the new tokens' keys (already in the pool too)
    v: torch.Tensor,  # [n, kv_heads, d]
    k_cache: KVSide,  # [kv_heads, num_slots, d] as read
    v_cache: KVSide,
    scale: float,
) -> torch.Tensor:
    """``_flash_over_pool`` over keys in several RoPE frames (``key_frames.py``): one
    unmasked call per run of each group (in place) or per gathered group, the queries rotated
    into the group's frame; with ``n > 1`` the new tokens' own causal call (their keys are not
    in the groups); every piece merged by its log-sum-exp. Groups made ``by_position`` (seam
    repair) hold every key, the new ones included: one masked call each, a row that sees none
    of a group left out of the merge. Returns ``[n, heads, d]``."""
    n, heads, d = q.shape
    kv_heads = k_cache.kv_heads
    qh = q.transpose(0, 1)  # [heads, n, d]
    moved = frames.queries(layer, qh) if frames.cos.shape[1] else None  # [f, heads, n, d]
    as_is = qh.contiguous()
    pieces = []
    for group in frames.groups:
        qf = as_is if group.frame < 0 else _frame(moved, group.frame)  # [heads, n, d]
        if group.mask is not None:  # by position: [1, heads, n, d] against the group's keys, the mask decides
            assert group.slots is not None and group.blind is not None  # by_position groups carry both
            qm = qf.unsqueeze(0)
            o, lse = flash(
                qm,
                k_cache.select(group.slots)[None],
                v_cache.select(group.slots)[None],
                scale,
                mask=group.mask,
            )  # [1, heads, n, d], [1, heads, n]
            pieces.append((o, lse.masked_fill(group.blind, float("-inf"))))
            continue
        qg = qf.view(1, kv_heads, heads // kv_heads * n, d)
        if group.slots is not None:  # [1, kv, g*n, d]: rows (group, token), each key read once per KV head
            pieces.append(flash(qg, k_cache.select(group.slots)[None], v_cache.select(group.slots)[None], scale))
        else:
            pieces.extend(flash(qg, k_cache.run(a, m)[None], v_cache.run(a, m)[None], scale) for a, m in group.runs)
    pieces = [(o.view(1, heads, n, d), lse.reshape(1, heads, n)) for o, lse in pieces]
    if n > 1 and not frames.masked:
        pieces.append(
            flash(qh.unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), scale, causal=True)
        )
    return merge(pieces)[0].transpose(0, 1)  # [n, heads, d]


def _frame(moved: torch.Tensor | None, frame: int) -> torch.Tensor:
    """The queries rotated into ``frame``, ``[heads, n, d]``: ``moved`` is None only when
    the frames hold no shifted group, and then no group asks for one."""
    assert moved is not None
    return moved[frame]


def _grouped_attention(
    q: torch.Tensor,  # [heads, n, d]
    ks: list[torch.Tensor],  # pieces of the keys in attention order, each [kv_heads, L_i, d]
    vs: list[torch.Tensor],  # matching values, each [kv_heads, L_i, d]
    mask: torch.Tensor,  # [n, L] bool (True = attend)
    scale: float,
) -> torch.Tensor:
    """Masked attention of a few queries over a long context (sliding-window layers), as
    batched matmuls per KV head group (no K/V repetition for GQA); the keys may come in
    pieces (views into the pool). Returns ``[heads, n, d]``."""
    heads, n, d = q.shape
    kv_heads = ks[0].shape[0]
    groups = heads // kv_heads
    # Scale the few queries, not the long score rows: one pass over [kv, g*n, L] saved.
    qg = (q * scale).reshape(kv_heads, groups * n, d)  # head h uses kv head h // groups, as repeat_kv does
    length = sum(k.shape[1] for k in ks)
    # Each piece's scores land in their columns directly (bmm into a view): no concatenation.
    scores = torch.empty(kv_heads, groups * n, length, dtype=q.dtype, device=q.device)  # [kv, g*n, L]
    offset = 0
    for k in ks:
        torch.bmm(qg, k.transpose(1, 2), out=scores[..., offset : offset + k.shape[1]])
        offset += k.shape[1]
    scores.view(kv_heads, groups, n, length).masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [kv, g*n, L]
    out = None
    offset = 0
    for v in vs:
        piece = torch.bmm(probs[..., offset : offset + v.shape[1]], v)  # [kv_heads, groups*n, d]
        out = piece if out is None else out.add_(piece)
        offset += v.shape[1]
    assert out is not None  # vs holds at least one piece
    return out.view(heads, n, d)


def register() -> str:
    """Make ``paged_attention`` available as ``attn_implementation="kvreuse"``. Idempotent."""
    AttentionInterface.register(ATTN_NAME, paged_attention)
    return ATTN_NAME
