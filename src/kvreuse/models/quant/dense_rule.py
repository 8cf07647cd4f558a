"""When a quantized CPU layer multiplies a transient dequantized copy of its weight instead of
calling the int kernel: a pure rule of the row count, the activation dtype and the CPU.

The layers read :func:`dense_dtype` through this module at call time
(``dense_rule.dense_dtype(...)``), so ``bench/quant_prefill.py`` can swap in another rule.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = [
    "DENSE_MIN_ROWS",
    "SLOW_BF16_DENSE_MIN_ROWS",
    "FP32_DENSE_MIN_ROWS",
    "fast_bf16_cpu",
    "dense_dtype",
    "dense_linear",
]

# From this many rows a bf16 int4 layer multiplies a transient dequantized copy instead of
# calling the int4 kernel (whose cost is ~linear in rows): bench/int4_rows.py, one decoder
# layer at 2 threads: 128 rows 4.97 vs 5.61 ms, 192 rows 7.41 vs 5.88 ms, 512 rows 19.9 vs 7.3 ms.
DENSE_MIN_ROWS = 160
# Without native bf16 (an AVX2-only EPYC) a bf16 GEMM is emulated (one decoder layer's four
# matmuls over a dequantized copy at 512 rows: bf16 191 ms, fp32 34 ms, the int4 kernel 45 ms),
# so a many-row call multiplies an fp32 copy, from where it beats the kernel there (three runs of
# bench/int4_rows.py --tag _epyc_bf16: kernel ahead to 128 rows, about a tie at 192-256, fp32
# ahead at 512). With fp32 activations the int kernels cost ~1 ms per
# row of a 1,536 x 576 layer on that CPU (int4 and int8 alike; a 2,000-token prefill of the
# default model with --dtype float32 and auto quantization took 222 s, unquantized 4.8 s), so
# from a few rows the dense fp32 product wins (bench/int4_rows.py --act float32).
SLOW_BF16_DENSE_MIN_ROWS = 256
FP32_DENSE_MIN_ROWS = 8


@lru_cache(maxsize=1)
def fast_bf16_cpu() -> bool:
    """True when this CPU multiplies bf16 natively (AMX tiles or AVX512-BF16).

    Read from ``/proc/cpuinfo`` flags (``amx_bf16``, ``avx512_bf16``); False when unreadable.
    On such CPUs bf16 GEMM runs several times fp32's rate (measured here: AMX Xeon ~7x,
    AVX512-BF16 EPYC ~4x) and the int8 kernel is only fast with bf16 activations.
    """
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return bool(flags & {"amx_bf16", "avx512_bf16"})
    return False


def dense_dtype(rows: int, x_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype in which a quantized CPU layer multiplies a call of ``rows`` rows densely (over
    a transient dequantized copy of its weight), or None to call the int kernel. Pure: depends on
    the row count, the activation dtype and whether this CPU multiplies bf16 natively."""
    if x_dtype == torch.float32:
        return torch.float32 if rows >= FP32_DENSE_MIN_ROWS else None
    if x_dtype == torch.bfloat16:
        if fast_bf16_cpu():
            return torch.bfloat16 if rows >= DENSE_MIN_ROWS else None
        return torch.float32 if rows >= SLOW_BF16_DENSE_MIN_ROWS else None
    return None


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` in ``weight``'s dtype, returned in ``x``'s."""
    y = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    return y.to(x.dtype)
