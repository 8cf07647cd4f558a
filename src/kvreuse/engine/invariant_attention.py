"""Batch-invariant attention: a query's output does not depend on what else shares its call.

Why: PyTorch's CPU flash kernel picks its query and key blocking, and on few queries a split
of the keys across threads, from the call's shape. A token computed in a 1,500-token prefill
chunk and the same token computed as the 3-token suffix of a cached prompt (or as a decode
beside three other streams) then round differently, and at temperature 0 a near-tie can flip
(issue 31, finding 3). ``--deterministic`` routes every full-attention read here instead.

The contract: for query ``i`` of a sequence (logical index ``c + i`` among its keys, which
are in attention order), the output is a fixed function of that query row and keys
``0..c+i``, whatever ``n``, ``c``, the pool slots or the batch are. How:

- keys are cut into tiles of ``TILE`` keys aligned at logical index 0 (tile ``j`` holds keys
  ``[j T, (j+1) T)``, the last one padded with zero keys that are masked);
- each tile is one fp32 ``bmm`` of fixed inner size (``d`` for the scores, ``TILE`` for
  ``p @ v``) over at least ``MIN_ROWS`` rows: CPU sgemm takes another kernel below 8 rows,
  at or above it each row's reduction order is fixed (tests/engine/test_invariant_attention.py);
- the softmax runs online over the tiles in order: a tile a row cannot see changes its
  running max, sum and output by exactly nothing (``max(m, -inf) = m``, ``exp(0) = 1``,
  ``+ 0``), so the rows that skip it (a suffix of the queries sees each tile) get the same
  bits as if they had not;
- the rest is elementwise (IEEE-exact add, mul, div, max) or ``exp`` (the same bits for an
  element whatever the tensor's size or layout: measured, tests/engine/test_invariant_attention.py)
  and reductions along a fixed ``TILE`` (sum) or exact ones (max, cummax).

The scores and the softmax are fp32 (more exact than the flash kernel's bf16 path, and
slower: the cost is in docs/deterministic.md). No pool.

In bf16 on CPU, where kvreuse's kernels are built, the same contract is kept by
``causal_attention`` / ``decode_attention`` (models/kernels/attention.cpp: items of 256 keys
aligned at key 0, each row's arithmetic fixed), at about the flash kernel's speed; the torch
tiles above are the fallback (fp32, no compiler, another device).
"""

from __future__ import annotations

import torch

from kvreuse.engine.flash import kernels_read
from kvreuse.engine.kv_quant import dequantize

TILE = 256  # keys per tile
MIN_ROWS = 8  # query rows per KV head are padded to this: below 8 rows CPU sgemm takes another kernel
BLOCK_TOKENS = 256  # queries attended together: each block reads only the tiles its last query sees
DECODE_MAX_GROUPS = 16  # query heads per KV head decode_attention stacks (attention.cpp: kMaxRowsDecode)


def attend(
    q: torch.Tensor,  # [n, heads, d] the new tokens' queries (RoPE applied)
    k: torch.Tensor,  # [kv_heads, L, d] every key in attention order, the new tokens' last (L = c + n)
    v: torch.Tensor,  # [kv_heads, L, d]
    scale: float,
    slots: torch.Tensor | None = None,  # [L] int64: k, v are pool sides [kv_heads, rows, d], key j at row slots[j]
) -> torch.Tensor:
    """Causal attention of ``n`` new tokens over ``L`` keys (new token ``i`` sees keys
    ``0..L-n+i``): ``[n, heads, d]`` in ``q``'s dtype, each row independent of ``n`` and of
    anything else in the batch (module docstring). ``heads`` a multiple of ``kv_heads``.
    ``k``, ``v`` may be an int8 pool's stored rows (``[kv, L, d + 2]`` uint8); with ``slots``
    they are whole pool sides read at those rows (no gather on the kernel path).

    bf16 on CPU with kvreuse's kernels built: ``causal_attention`` (a decode through
    ``decode_attention``, the same bits), rows read in place. Otherwise queries run in blocks of
    ``BLOCK_TOKENS``, each over the tiles its last query sees, in fp32 torch."""
    if _native(q, k, v):
        n, heads, d = q.shape
        kv_heads = k.shape[0]
        if n == 1 and heads // kv_heads <= DECODE_MAX_GROUPS:  # the keys split across threads
            qg = q.view(1, kv_heads, heads // kv_heads, d)  # [1, kv, groups, d]
            return torch.ops.kvreuse.decode_attention(qg, k[None], v[None], scale, slots)[0].view(1, heads, d)
        return torch.ops.kvreuse.causal_attention(q, k, v, scale, slots)
    if slots is not None:  # the torch path reads gathered keys
        k, v = k.index_select(1, slots), v.index_select(1, slots)
    if k.dtype == torch.uint8:  # int8 pool rows: the torch path reads them dequantized
        k, v = dequantize(k, q.dtype), dequantize(v, q.dtype)
    n, heads, d = q.shape
    kv_heads, length = k.shape[0], k.shape[1]
    context = length - n
    tiles = -(-length // TILE)
    kt = torch.zeros(kv_heads, d, tiles * TILE, dtype=torch.float32, device=k.device)  # [kv, d, tiles T]
    vf = torch.zeros(kv_heads, tiles * TILE, d, dtype=torch.float32, device=k.device)  # [kv, tiles T, d]
    kt[..., :length] = k.transpose(1, 2)
    vf[:, :length] = v
    vt = vf.view(kv_heads, tiles, TILE, d)  # [kv, tiles, T, d]
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    for start in range(0, n, BLOCK_TOKENS):
        end = min(n, start + BLOCK_TOKENS)
        seen = -(-(context + end) // TILE)  # tiles the block's last query sees
        out[start:end] = _block(q[start:end], context + start, kt[..., : seen * TILE], vt[:, :seen], scale)
    return out


def _native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether kvreuse's attention kernels take this call (``flash.kernels_read``), ``k`` and
    ``v`` read with one set of strides."""
    return v.stride() == k.stride() and kernels_read(q, k)


def _block(
    q: torch.Tensor,  # [b, heads, d] queries at logical indices first..first+b-1
    first: int,
    kt: torch.Tensor,  # [kv, d, tiles T] fp32 keys, transposed
    vt: torch.Tensor,  # [kv, tiles, T, d] fp32 values
    scale: float,
) -> torch.Tensor:
    """One block of queries over ``tiles`` key tiles: the online softmax over the tiles in
    order, every tile's scores, exps and ``p @ v`` computed at once. ``[b, heads, d]``."""
    b, heads, d = q.shape
    kv_heads, tiles = vt.shape[0], vt.shape[1]
    groups = heads // kv_heads
    rows = b * groups
    padded = max(MIN_ROWS, rows)
    qg = torch.zeros(kv_heads, padded, d, dtype=torch.float32, device=q.device)  # [kv, R, d] rows (token, group)
    qg[:, :rows] = q.view(b, kv_heads, groups, d).transpose(0, 1).reshape(kv_heads, rows, d)
    qg.mul_(scale)
    token = (torch.arange(padded, device=q.device) // groups).clamp_(max=b - 1)  # [R] padding rows: the last token
    key = torch.arange(tiles * TILE, device=q.device)  # [tiles T] logical key index
    hidden = key[None, :] > (first + token)[:, None]  # [R, tiles T] True = not visible (later or padding)
    s = torch.bmm(qg, kt).masked_fill_(hidden, float("-inf"))  # [kv, R, tiles T] scaled scores
    s4 = s.view(kv_heads, padded, tiles, TILE)
    # running max over the tiles ([kv, tiles, R]); tile 0 holds key 0, visible to every row,
    # so it is finite; a tile a row cannot see leaves it as it was
    m = torch.cummax(s4.amax(dim=-1).transpose(1, 2).contiguous(), dim=1).values  # [kv, tiles, R]
    p = torch.exp(s4.sub_(m.transpose(1, 2).unsqueeze(-1)))  # [kv, R, tiles, T], 0 where hidden
    psum = p.sum(dim=-1).transpose(1, 2).contiguous()  # [kv, tiles, R]
    pv = torch.matmul(p.transpose(1, 2), vt)  # [kv, tiles, R, d]: one fixed-shape product per tile
    alpha = torch.exp(m[:, :-1] - m[:, 1:])  # [kv, tiles - 1, R]: 1 exactly where the max stayed
    total, acc = psum[:, 0], pv[:, 0]  # [kv, R], [kv, R, d]
    for j in range(1, tiles):
        a = alpha[:, j - 1]  # [kv, R]
        total = total * a + psum[:, j]
        acc = acc * a.unsqueeze(-1) + pv[:, j]
    o = (acc / total.unsqueeze(-1))[:, :rows]  # [kv, b * g, d]
    return o.view(kv_heads, b, groups, d).transpose(0, 1).reshape(b, heads, d).to(q.dtype)
