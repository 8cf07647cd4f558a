"""Batch-invariant projections and norms: a row's output does not depend on the rows beside it.

Why: the fast path picks a kernel by row count. A quantized layer multiplies a transient
dequantized copy from ``DENSE_MIN_ROWS`` rows and calls the int4 / int8 kernel below that
(``quant/dense_rule.py``); CPU sgemm takes other kernels below 8 and at 9-11 rows; the RMSNorm of a few
rows runs as a layer norm. The same token then rounds differently as one of 1,459 prompt rows
(a prefix-cache miss) and as one of 3 suffix rows (a hit), and a greedy answer can change
(issue 31, finding 3). ``--deterministic`` runs the Llama forward through this module instead:

- an int4 / int8 layer with a CPU kernel always calls the kernel: tinygemm's int4 kernel and
  the int8 kernel accumulate each row on its own in a fixed order (rows are independent at any
  count: tests/models/test_invariant.py); prefill pays the kernel's per-row cost;
- any dense product (``nn.Linear``, a layer without a kernel) runs on at least ``MIN_ROWS``
  rows (zero rows added and dropped), where CPU GEMM's kernel no longer changes with the count;
- RMSNorm is always ``F.rms_norm`` (per-row reductions), never the few-row layer-norm form.

Every function takes ``x [T, in]`` rows and returns ``[T, out]`` in ``x``'s dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.models.quant import Int4Linear, Int8Linear, Q6KLinear

# CPU sgemm (fp32) picks other kernels below 8 rows and again at 9-11 rows (a reviewer's scan on
# an AVX-512 EPYC, torch 2.13); from 16 rows on every count tried (up to 2,048) gives a row the
# same bits
MIN_ROWS = 16


def project(layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` with each row's result independent of the other rows of ``x [T, in]``.
    ``layer``: an ``nn.Linear``, an ``Int4Linear`` / ``Int8Linear``, or anything exposing
    ``parts`` (projections called one by one and concatenated)."""
    parts = getattr(layer, "parts", None)
    if parts is not None:
        return torch.cat([project(p, x) for p in parts], dim=-1)
    if isinstance(layer, (Int4Linear, Int8Linear, Q6KLinear)) and layer.native:  # each row alone by construction
        return layer.native_linear(x.contiguous())
    if isinstance(layer, Int4Linear) and layer.use_kernel:
        sz = layer.scale_zero if layer.scale_zero.dtype == x.dtype else layer.scale_zero.to(x.dtype)
        y = torch._weight_int4pack_mm_for_cpu(x.contiguous(), layer.qweight, layer.group, sz)
        return y if layer.bias is None else y + layer.bias
    if isinstance(layer, Int8Linear) and layer.use_kernel:
        scale = layer.scale if layer.scale.dtype == x.dtype else layer.scale.to(x.dtype)
        y = torch._weight_int8pack_mm(x.contiguous(), layer.qweight, scale)
        return y if layer.bias is None else y + layer.bias
    weight: torch.Tensor
    bias: torch.Tensor | None
    if isinstance(layer, nn.Linear):
        weight, bias = layer.weight, layer.bias
    elif isinstance(layer, (Int4Linear, Int8Linear)):  # no kernel here: codes dequantized on the fly
        weight, bias = layer.dequantized_weight().to(x.dtype), layer.bias
    else:
        raise TypeError(f"deterministic forward: no batch-invariant form for {type(layer).__name__}")
    return dense(x, weight, bias)


def dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` over at least ``MIN_ROWS`` rows: ``[T, out]``."""
    rows = x.shape[0]
    if rows >= MIN_ROWS:
        return F.linear(x, weight, bias)
    padded = torch.zeros(MIN_ROWS, x.shape[1], dtype=x.dtype, device=x.device)  # [MIN_ROWS, in]
    padded[:rows] = x
    return F.linear(padded, weight, bias)[:rows]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm`` over the last dim of ``x [T, hidden]``, one row at a time in effect."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
