"""``Int8Linear``: symmetric int8 weights, one scale per output channel, on
``torch._weight_int8pack_mm``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.models.quant import dense_rule

__all__ = ["Int8Linear"]


class Int8Linear(nn.Module):
    """``y = x @ (q * scale[:, None]).T (+ bias)``; ``q`` int8 ``[out, in]``, ``scale`` ``[out]``."""

    # buffers (register_buffer): declared so the type checker knows them
    qweight: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out], the activation dtype
    bias: torch.Tensor | None  # [out]

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
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

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[out, in]`` in ``dtype`` (default: the scale's, the activation dtype)."""
        dtype = dtype or self.scale.dtype
        return self.qweight.to(dtype) * self.scale.to(dtype)[:, None]  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_kernel:
            return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)
        dense = dense_rule.dense_dtype(x.numel() // self.in_features, x.dtype)
        if dense == torch.float32:  # a prefill chunk off native bf16 / fp32 activations: one fp32
            # GEMM beats the kernel's per-row cost (EPYC, 1,536 x 576 at 512 bf16 rows: 7.1 vs 16 ms);
            # with native bf16 the kernel stays (not measured against a dense bf16 copy there)
            return dense_rule.dense_linear(x, self.dequantized_weight(dense), self.bias)
        scale = self.scale if self.scale.dtype == x.dtype else self.scale.to(x.dtype)
        if x.dim() == 2:  # the own forward's [T, in]: no reshapes (a decode step is mostly small calls)
            y = torch._weight_int8pack_mm(x, self.qweight, scale)
        else:
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, scale)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.use_kernel}"
