"""``Int8Linear``: symmetric int8 weights, one scale per output channel, on kvreuse's own CPU
kernel (:mod:`kvreuse.models.kernels`) for few-row calls where it is built, else on
``torch._weight_int8pack_mm``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.models.kernels import native_kernels
from kvreuse.models.kernels.packing import pack_q8, q8_packable, unpack_q8
from kvreuse.models.quant import dense_rule

__all__ = ["Int8Linear", "NATIVE_MAX_ROWS"]

# The native kernel re-reads the weights every 4 rows; from here a dense product over an
# unpacked copy costs less (an assumption to measure: bench/quant/int4_rows.py)
NATIVE_MAX_ROWS = 32


class Int8Linear(nn.Module):
    """``y = x @ (q * scale[:, None]).T (+ bias)``; ``q`` int8 ``[out, in]``, ``scale`` ``[out]``.

    With kvreuse's kernels built (``native``), ``qweight`` is held in their int8 layout
    (``kvreuse.models.kernels.packing``) and a call of fewer than ``NATIVE_MAX_ROWS`` rows runs
    ``torch.ops.kvreuse.q8_linear`` (activations quantized to int8 per group of 32); a larger
    call multiplies a transient unpacked copy with torch's kernel."""

    # buffers (register_buffer): declared so the type checker knows them
    qweight: torch.Tensor  # [out, in] int8; native: [out/16, in/4, 64] uint8
    scale: torch.Tensor  # [out], the activation dtype
    scale_bits: torch.Tensor  # native: the scale as float32 bits in int32 [out] (.to(dtype) leaves it)
    bias: torch.Tensor | None  # [out]

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype, native: bool | None = None
    ) -> None:
        """``native``: None uses kvreuse's kernel where it is built and fits; False keeps torch's."""
        super().__init__()
        w = weight.detach().float()  # [out, in]
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)  # [out]
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(act_dtype))
        self.register_buffer("bias", None if bias is None else bias.detach().to(act_dtype))
        # torch's CPU int8 kernel is wrong (inf, NaN, or a crash) in bf16/fp16 when ``in`` is not a
        # multiple of 16 (measured on torch 2.13 with in = 8, 24, 40, 56, 72); fp32 is right for any
        self.use_kernel = w.device.type == "cpu" and (act_dtype == torch.float32 or self.in_features % 16 == 0)
        fits = native is not False and self.use_kernel and q8_packable(*w.shape) and act_dtype == torch.bfloat16
        kernels = native_kernels() if fits else None
        self.native = kernels is not None
        self.q8_unsigned = kernels is not None and kernels.q8_unsigned
        if self.native:
            packed, scale32 = pack_q8(self.qweight, self.scale.float(), self.q8_unsigned)
            self.register_buffer("qweight", packed)
            self.register_buffer("scale_bits", scale32.view(torch.int32))

    def int8_weight(self) -> torch.Tensor:
        """``q [out, in]`` int8, whatever the layout."""
        return unpack_q8(self.qweight, self.q8_unsigned) if self.native else self.qweight

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[out, in]`` in ``dtype`` (default: the scale's, the activation dtype)."""
        dtype = dtype or self.scale.dtype
        return self.int8_weight().to(dtype) * self.scale.to(dtype)[:, None]  # [out, in]

    def native_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` (contiguous, bf16 / fp32) through the native kernel: ``[T, out]``, each
        row computed alone (batch-invariant)."""
        y = torch.ops.kvreuse.q8_linear(x, self.qweight, self.scale_bits)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_kernel:
            return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)
        dense = dense_rule.dense_dtype(x.numel() // self.in_features, x.dtype)
        if dense == torch.float32:  # a prefill chunk off native bf16 / fp32 activations: one fp32
            # GEMM beats the kernel's per-row cost (EPYC, 1,536 x 576 at 512 bf16 rows: 7.1 vs 16 ms);
            # with native bf16 the kernel stays (not measured against a dense bf16 copy there)
            return dense_rule.dense_linear(x, self.dequantized_weight(dense), self.bias)
        if self.native:
            if x.numel() // self.in_features < NATIVE_MAX_ROWS:
                y = self.native_linear(x.reshape(-1, self.in_features).contiguous())
                return y.view(*x.shape[:-1], self.out_features)
            return F.linear(x, self.dequantized_weight(x.dtype), self.bias)
        scale = self.scale if self.scale.dtype == x.dtype else self.scale.to(x.dtype)
        if x.dim() == 2:  # the own forward's [T, in]: no reshapes (a decode step is mostly small calls)
            y = torch._weight_int8pack_mm(x, self.qweight, scale)
        else:
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, scale)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        kernel = "kvreuse" if self.native else "torch" if self.use_kernel else "none"
        return f"in={self.in_features}, out={self.out_features}, kernel={kernel}"
