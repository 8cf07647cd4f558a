"""Attention kernels with one contract for every read path of ``attention.py``: the output of
``softmax(q k^T * scale) v`` and each row's log-sum-exp, so pieces of a key set attended apart
merge into attention over the whole (``merge``). On CPU kvreuse's decode kernel for a few
unmasked query rows per KV head (``models/kernels``: the keys split across threads) and
PyTorch's flash kernel otherwise; elsewhere fp32
matmuls (cuBLAS on CUDA). Shapes: ``q [B, H, n, d]``, ``k, v [B, kv, L, d]`` with ``H`` a
multiple of ``kv`` (head ``h`` uses kv head ``h // (H / kv)``). Pure torch; no pool.
"""

from __future__ import annotations

import torch

from kvreuse.engine.kv_quant import dequantize
from kvreuse.models.kernels import native_kernels

NATIVE_MAX_ROWS = 16  # query rows per KV head kvreuse's decode kernel takes (attention.cpp: kMaxRowsDecode)


def kernels_read(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether kvreuse's attention kernels (``decode_attention``, ``causal_attention``) can read
    these tensors: bf16 queries on CPU (``--dtype float32`` stays the exact reference on
    PyTorch's kernels, docs/kernels.md), bf16 or int8-pool rows of ``d`` contiguous, ``d`` a
    multiple of 16 up to 256, the kernels built."""
    d = q.shape[-1]
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and k.dtype in (torch.bfloat16, torch.uint8)
        and d % 16 == 0
        and d <= 256
        and k.stride(-1) == 1
        and native_kernels() is not None
    )


def _native_fits(q: torch.Tensor, k: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> bool:
    """Whether kvreuse's decode-attention kernel takes this call: one sequence, a few unmasked
    query rows per KV head (a decode's stacked query heads), rows the kernels read."""
    return (
        not causal
        and mask is None
        and q.shape[0] == 1
        and q.shape[1] == k.shape[1]
        and q.shape[2] <= NATIVE_MAX_ROWS
        and kernels_read(q, k)
    )


def flash(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention ``softmax(q k^T * scale) v`` and each row's log-sum-exp of the scaled scores:
    ``([B, H, n, d], [B, H, n] fp32)`` for ``q [B, H, n, d]``, ``k, v [B, kv, L, d]``
    (``H`` a multiple of ``kv``, head ``h`` using kv head ``h // (H / kv)``); ``causal``
    needs ``n == L``. On CPU: PyTorch's flash kernel in the inputs' dtype (strided inputs
    read in place; bf16 rows accumulate in fp32 inside the kernel, and run on AMX where the
    CPU has it: 32 queries over 4,096 keys, 2 threads, 0.81 ms in bf16 against 3.5 ms over
    fp32 copies). Elsewhere: matmuls with fp32 scores (cuBLAS on CUDA), the same contract.
    ``mask``: additive ``[n, L]`` in ``q``'s dtype (``-inf`` hides a key); a row it hides
    entirely comes out 0 with an undefined log-sum-exp (the caller drops it)."""
    if q.device.type != "cpu":
        return math_attention(q, k, v, scale, causal, mask)
    if _native_fits(q, k, causal, mask) and v.stride() == k.stride():
        out, lse = torch.ops.kvreuse.decode_attention(q, k, v, scale)
        return out, lse
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )
    return out, lse


def attend_alone(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``flash``'s output alone, for a caller that merges nothing (a decode over one run, or
    gathered): ``[B, H, n, d]``. On CPU kvreuse's decode kernel where it fits, else PyTorch's
    flash kernel in every dtype, as ``flash`` (one call replaces ~9 ops and 4 dtype casts per
    layer); elsewhere ``math_attention`` (cuBLAS on CUDA). ``k``, ``v`` may also be an int8
    pool's stored rows (``[B, kv, L, d + 2]`` uint8, ``KVSide.stored_run``): the decode kernel
    reads them as stored, any other path gets them dequantized first."""
    if q.device.type == "cpu" and _native_fits(q, k, False, None) and v.stride() == k.stride():
        return torch.ops.kvreuse.decode_attention(q, k, v, scale)[0]
    if k.dtype == torch.uint8:  # int8 pool rows (KVSide.stored_run) the kernel did not take
        k, v = dequantize(k, q.dtype), dequantize(v, q.dtype)
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)[0]
    return math_attention(q, k, v, scale, False)[0]


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash``'s contract with plain matmuls (any device): fp32 scores ``[B, kv, g*n, L]``."""
    b, heads, n, d = q.shape
    kv = k.shape[1]
    qg = q.reshape(b, kv, heads // kv * n, d).float()  # head h = (kv head, group): rows (group, token)
    scores = torch.matmul(qg, k.float().transpose(-1, -2)) * scale  # [B, kv, g*n, L]
    if causal:
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu_(1)  # [n, n] True = not yet
        scores.view(b, kv, heads // kv, n, -1).masked_fill_(future, float("-inf"))
    if mask is not None:
        scores.view(b, kv, heads // kv, n, -1).add_(mask.float())  # [n, L] broadcast over heads
    lse = torch.logsumexp(scores, dim=-1)  # [B, kv, g*n]
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num_(0.0)  # a row hidden entirely: 0, as the CPU kernel
    out = torch.matmul(probs, v.float())  # [B, kv, g*n, d]
    return out.view(b, heads, n, d).to(q.dtype), lse.view(b, heads, n)


def merge(pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Attention over the union of disjoint key sets from each set's ``(out [..., n, d],
    lse [..., n])``: ``sum_i out_i * exp(lse_i - logsumexp_i lse_i)``, in the outputs' dtype."""
    if len(pieces) == 1:
        return pieces[0][0]
    weights = torch.softmax(torch.stack([p[1] for p in pieces]), dim=0).unsqueeze(-1)  # [r, ..., n, 1] fp32
    outs = torch.stack([p[0] for p in pieces]).float()  # [r, ..., n, d]
    return (outs * weights).sum(0).to(pieces[0][0].dtype)
