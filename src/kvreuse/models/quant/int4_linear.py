"""``Int4Linear``: asymmetric 4-bit weights, one (scale, min) per group of ``INT4_GROUP`` input
channels, on kvreuse's own CPU kernel (:mod:`kvreuse.models.kernels`) where it is built, else on
``torch._weight_int4pack_mm_for_cpu`` (tinygemm layout)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.models.kernels import native_kernels
from kvreuse.models.kernels.packing import pack_q4, q4_packable
from kvreuse.models.quant import dense_rule
from kvreuse.models.quant.int4_pack import INT4_PACK_ROWS, int4_pack_layout, int4_pack_order
from kvreuse.models.quant.mode import INT4_GROUP

__all__ = ["Int4Linear"]


def _int4_codes(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max 4-bit codes of ``w [out, in]``: ``(q int32 [out, in] in 0..15, scale, zero)``,
    scale and zero ``[out, in/group]`` fp32, with ``w ~= (q - 8) * scale + zero``."""
    n, k = w.shape
    wg = w.float().view(n, k // group, group)
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)  # [out, groups, 1]
    q = torch.round((wg - lo) / scale).clamp(0, 15).to(torch.int32).view(n, k)
    return q, scale.view(n, -1), (lo + 8.0 * scale).view(n, -1)


def _symmetric_codes(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A GGUF Q4_0 tensor's own codes: ``(q int32 [out, in] in 0..15, d fp32 [out, in/group])``
    with ``w == (q - 8) * d`` exactly in every group and ``d``, ``-8 * d`` float16 values; None
    when any group is off that grid (then min-max codes, which need a min per group, are used).

    Why: Q4_0 maps a group's largest magnitude to code 0 (``d = peak / -8``) and dequantizes in
    fp32 exactly, so ``d`` is read back from the peak; min-max codes re-derived from the same
    values hold a min per group (10% more bytes) and are off the file's grid whenever code 15 is
    unused."""
    n, k = w.shape
    wg = w.float().view(n, k // group, group)
    peak = wg.gather(-1, wg.abs().argmax(dim=-1, keepdim=True))  # [out, groups, 1]
    d = peak / -8.0
    if not (torch.equal(d.half().float(), d) and bool(torch.isfinite((8 * d).half()).all())):
        return None
    q = torch.where(d == 0, 8.0, torch.round(wg / torch.where(d == 0, 1.0, d)) + 8)
    if not (bool(((q >= 0) & (q <= 15)).all()) and torch.equal((q - 8) * d, wg)):
        return None
    return q.to(torch.int32).view(n, k), d.view(n, -1)


class Int4Linear(nn.Module):
    """Group-wise 4-bit weights (``INT4_GROUP`` input channels per scale/zero).

    CPU with kvreuse's kernels built (``native``): ``kvreuse.models.kernels.packing``'s int4
    layout, ``torch.ops.kvreuse.q4_linear`` (activations quantized to int8 per group of 32, the
    scales kept as float16 so a GGUF Q4_1 / Q4_0 block's own scale and min are exact).
    CPU otherwise: packed by ``_convert_weight_to_int4pack_for_cpu`` and multiplied by
    ``_weight_int4pack_mm_for_cpu``. Elsewhere (or ``out % 16 != 0``): two codes per uint8,
    dequantized on the fly.
    """

    # buffers (register_buffer): declared so the type checker knows them
    # native: [out/16, in/32, 256] uint8; torch kernel: its packed rows; else [out, in/2] uint8, two codes a byte
    qweight: torch.Tensor
    # native: (scale, min) float16 bits as int16 [2, out/16, in/32, 16] (int16: a module's .to(dtype)
    # leaves it alone), or [1, ...] scales only for symmetric (Q4_0) groups; torch kernel: (scale, zero)
    # [in/group, out, 2]; else [out, groups, 2]
    scale_zero: torch.Tensor
    # native: scale_zero[0] and scale_zero[1], views kept so a decode call indexes nothing
    native_scale: torch.Tensor
    native_min: torch.Tensor
    bias: torch.Tensor | None  # [out]

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        act_dtype: torch.dtype,
        group: int = INT4_GROUP,
        native: bool | None = None,
    ) -> None:
        """``native``: None uses kvreuse's kernel where it is built and fits; False keeps torch's."""
        super().__init__()
        n, k = weight.shape
        if k % group:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group {group}")
        self.in_features, self.out_features, self.group = k, n, group
        self.act_dtype = act_dtype
        self.use_kernel = weight.device.type == "cpu" and n % 16 == 0
        self.native = (
            native is not False
            and self.use_kernel
            and group == 32
            and q4_packable(n, k)
            and act_dtype == torch.bfloat16
            and native_kernels() is not None
        )
        symmetric = _symmetric_codes(weight.detach(), group) if self.native else None
        if symmetric is not None:  # a Q4_0 tensor: its own codes and scales, no min plane
            packed, d, _ = pack_q4(symmetric[0], symmetric[1], None)  # w = (q - 8) * scale
            self.register_buffer("qweight", packed)
            self.register_buffer("scale_zero", d.unsqueeze(0).view(torch.int16))
            self.bind_native_scales()
            self.register_buffer("bias", None if bias is None else bias.detach().to(act_dtype))
            return
        q, scale, zero = _int4_codes(weight.detach(), group)
        if self.native:
            packed, d, m = pack_q4(q, scale, zero - 8 * scale)  # w ~= q * scale + min
            self.register_buffer("qweight", packed)
            self.register_buffer("scale_zero", torch.stack([d, m]).view(torch.int16))
            self.bind_native_scales()
        elif self.use_kernel:
            self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q, 1))  # [out, in/2] uint8
            # [in/group, out, 2]: the kernel's (scale, zero) layout
            self.register_buffer("scale_zero", torch.stack([scale.T, zero.T], dim=-1).contiguous().to(act_dtype))
        else:
            self.register_buffer("qweight", (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8))  # [out, in/2]
            self.register_buffer("scale_zero", torch.stack([scale, zero], dim=-1).to(act_dtype))  # [out, groups, 2]
        self.register_buffer("bias", None if bias is None else bias.detach().to(act_dtype))

    def dequantized_weight(self) -> torch.Tensor:
        """``[out, in]`` in the activation dtype (reference / fallback path)."""
        n, k, g = self.out_features, self.in_features, self.group
        if self.native:
            return self._native_weight(self.act_dtype)
        if self.use_kernel:  # the packed layout is opaque: multiply the identity through the kernel
            eye = torch.eye(k, dtype=self.scale_zero.dtype, device=self.qweight.device)
            return torch._weight_int4pack_mm_for_cpu(eye, self.qweight, g, self.scale_zero).T
        q = torch.stack([self.qweight & 0xF, self.qweight >> 4], dim=-1).view(n, k // g, g)
        scale, zero = self.scale_zero[..., 0:1], self.scale_zero[..., 1:2]  # [out, groups, 1]
        return ((q.to(scale.dtype) - 8) * scale + zero).view(n, k)

    def unpacked_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``[out, in]`` in ``dtype`` from the CPU-packed codes with tensor ops (a transient copy
        for a many-row call; ``dequantized_weight`` is the reference). The pack
        (``_convert_weight_to_int4pack_for_cpu``) stores rows in blocks of ``INT4_PACK_ROWS``,
        each block's nibbles in an order that depends on the CPU capability torch dispatches to
        (AVX512, AVX2 and the default kernels differ): ``int4_pack_order`` reads it off probe
        packs, so the unpack is the kernel's on any of them."""
        if self.native:
            return self._native_weight(dtype)
        n, k, g = self.out_features, self.in_features, self.group
        layout = int4_pack_layout(k)
        if layout == "avx512":  # byte [block, k, j] holds row j (low nibble) and j + 32 (high)
            packed = self.qweight.view(n // INT4_PACK_ROWS, k, INT4_PACK_ROWS // 2)
            q = torch.cat([packed & 0xF, packed >> 4], dim=2)  # [n / 64, k, 64] codes 0..15
            q = q.transpose(1, 2).reshape(n, k // g, g)  # [n, groups, g]
        elif layout == "avx2":  # byte [block, half, k, j] holds row 32 half + j (low) and 32 half + 16 + j (high)
            packed = self.qweight.view(n // INT4_PACK_ROWS, 2, k, 16)
            q = torch.stack([packed & 0xF, packed >> 4], dim=2)  # [n / 64, half, nibble, k, 16]
            q = q.transpose(3, 4).reshape(n, k // g, g)  # [n, groups, g]
        else:  # any other order: one gather by the probed order (slower)
            packed = self.qweight.view(n // INT4_PACK_ROWS, INT4_PACK_ROWS * k // 2)
            nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(n // INT4_PACK_ROWS, INT4_PACK_ROWS * k)
            q = nibbles[:, int4_pack_order(k)].view(n, k // g, g)  # [n, groups, g] codes 0..15
        scale = self.scale_zero[..., 0].float()  # [groups, n]
        low = (self.scale_zero[..., 1].float() - 8 * scale).t().unsqueeze(-1).to(dtype).contiguous()  # [n, groups, 1]
        return torch.addcmul(low, q.to(dtype), scale.t().unsqueeze(-1).to(dtype).contiguous()).view(n, k)

    def _native_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """``[out, in]`` in ``dtype`` from the native layout: ``code * scale + min`` in fp32,
        rounded once (the kernels' own ``q4_dequantize``; other dtypes cast from fp32)."""
        built = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
        return torch.ops.kvreuse.q4_dequantize(self.qweight, self.native_scale, self.native_min, built).to(dtype)

    def bind_native_scales(self) -> None:
        """Keep ``scale_zero``'s planes as plain attributes (call after ``scale_zero`` is set);
        a symmetric layer's ``native_min`` is empty (the kernels take ``-8 * scale``)."""
        sz = self.scale_zero
        self.__dict__["native_scale"] = sz[0]
        self.__dict__["native_min"] = sz[1] if sz.size(0) == 2 else sz.new_empty(0)

    @property
    def symmetric(self) -> bool:
        """Native layout without a min plane (a GGUF Q4_0 tensor's own codes)."""
        return self.native and self.scale_zero.size(0) == 1

    def native_planes(self, planes: int) -> torch.Tensor:
        """``scale_zero`` of the native layout with ``planes`` planes (1: scales only, for a
        symmetric layer; 2: scales and mins, a symmetric layer's mins written out as
        ``-8 * scale``, exact in float16): what fusing it with other layers concatenates."""
        sz = self.scale_zero
        if sz.size(0) == planes:
            return sz
        if planes != 2:
            raise ValueError("an asymmetric int4 layer has a min plane: it cannot drop it")
        return torch.stack([sz[0], (-8 * sz[0].view(torch.float16)).view(torch.int16)])

    def native_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` (contiguous, bf16 / fp32) through the native kernel: ``[T, out]``, each
        row computed alone (batch-invariant)."""
        d = self.__dict__  # not nn.Module.__getattr__ (~0.6 us a lookup; a decode step calls this ~120 times)
        y = torch.ops.kvreuse.q4_linear(x, d["_buffers"]["qweight"], d["native_scale"], d["native_min"])
        bias = d["_buffers"]["bias"]
        return y if bias is None else y + bias

    def native_fused(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        silu_mul: bool = False,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``native_linear`` with a decoder layer's small ops folded in (no bias allowed):
        ``x [T, in]`` RMS-normed by ``norm_weight`` first, or ``x [T, 2 in]`` taken as
        ``silu(x[:, :in]) * x[:, in:]``; ``residual [T, out]`` added to the result. Each step
        rounds to bf16 where the separate ops would (tests/models/test_kernels.py). Raises
        RuntimeError for a shape or dtype the kernel refuses."""
        d = self.__dict__
        return torch.ops.kvreuse.q4_linear_fused(
            x, d["_buffers"]["qweight"], d["native_scale"], d["native_min"], norm_weight, eps, silu_mul, residual
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_kernel:
            return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)
        dense = dense_rule.dense_dtype(x.numel() // self.in_features, x.dtype)
        if dense is not None and (self.native or self.out_features % INT4_PACK_ROWS == 0):
            # a prefill chunk: the kernel's cost grows with rows (it decodes the codes per row
            # block), one dense GEMM over a transient dequantized copy does not
            return dense_rule.dense_linear(x, self.unpacked_weight(dense), self.bias)
        if self.native:
            y = self.native_linear(x.reshape(-1, self.in_features).contiguous())
            return y.view(*x.shape[:-1], self.out_features)
        sz = self.scale_zero if self.scale_zero.dtype == x.dtype else self.scale_zero.to(x.dtype)
        if x.dim() == 2:  # the own forward's [T, in]: no reshapes
            y = torch._weight_int4pack_mm_for_cpu(x, self.qweight, self.group, sz)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.qweight, self.group, sz)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        kernel = (
            ("kvreuse-q4_0" if self.symmetric else "kvreuse") if self.native else "torch" if self.use_kernel else "none"
        )
        return f"in={self.in_features}, out={self.out_features}, group={self.group}, kernel={kernel}"
