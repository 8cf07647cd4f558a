"""Weight-only quantization: int8 / int4 linear layers on PyTorch's own CPU kernels.

Why: a decode step reads every weight once. SmolLM2-135M in fp32 is 540 MB per token; its
GGUF (Q4_1 layers, Q8_0 embedding) is 98 MB. Keeping the weights compact is what lets batch-1
decode approach the memory system's limit.

Schemes (``SCHEMES`` names them; the name is folded into the model fingerprint):

- ``int8``: symmetric, one scale per output channel, ``torch._weight_int8pack_mm``
  (``y = (x @ q.T) * scale``). The kernel wants bf16 activations: with fp32 ones it is
  5-15x slower than a plain fp32 matmul (docs in MODELS.md), so pair it with ``dtype=bf16``.
- ``int4``: asymmetric, one (scale, min) per group of 32 input channels, tinygemm layout
  ``w = (q - 8) * scale + zero`` with ``zero = min + 8 * scale``,
  ``torch._weight_int4pack_mm_for_cpu``. A GGUF Q4_1 block is exactly this (32 weights,
  ``w = q * d + m``), so requantizing a Q4_1-dequantized weight recovers the file's own codes.
- A tied or plain ``nn.Embedding`` becomes int8 with one scale per group of 32 (a GGUF Q8_0
  block, recovered exactly from its dequantized values); the lookup gathers rows and scales.

Kernels are CPU only (``_weight_int8pack_mm`` / ``_weight_int4pack_mm_for_cpu``; the packed
int4 layout is CPU specific). On any other device, or for a shape the kernel refuses (int4 needs
``out_features % 16 == 0``), a layer keeps its codes unpacked and dequantizes on the fly
(``F.linear`` over the dequantized weight): correct everywhere, compact in memory, not fast.
"""

from __future__ import annotations

import enum
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["QuantMode", "SCHEMES", "parse_quantization", "fast_bf16_cpu", "Int8Linear", "Int4Linear",
           "Int8Embedding", "dense_dtype", "fuse_linears", "fused_projection", "quantize_model", "weight_bytes"]

INT4_GROUP = 32  # input channels per (scale, zero) group; a GGUF Q4_1 / Q8_0 block
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
EMBED_GROUP = 32


class QuantMode(enum.Enum):
    NONE = "none"
    INT8 = "int8"
    INT4 = "int4"


# What each mode does, as folded into the model fingerprint; change the text when the math changes.
SCHEMES: dict[QuantMode, str] = {
    QuantMode.NONE: "none",
    QuantMode.INT8: "int8-sym-per-channel;embed-int8-g32;lm_head-int8;v1",
    QuantMode.INT4: f"int4-asym-g{INT4_GROUP};embed-int8-g{EMBED_GROUP};lm_head-int8;v1",
}


def parse_quantization(mode: str | QuantMode) -> QuantMode:
    """``none|int8|int4`` (or a QuantMode) to a QuantMode. Raises ValueError otherwise."""
    if isinstance(mode, QuantMode):
        return mode
    try:
        return QuantMode(str(mode).strip().lower())
    except ValueError:
        raise ValueError(f"unknown quantization '{mode}'; use auto, none, int8 or int4") from None


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


def _dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` in ``weight``'s dtype, returned in ``x``'s."""
    y = F.linear(x.to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    return y.to(x.dtype)


# --------------------------------------------------------------------------- layers

class Int8Linear(nn.Module):
    """``y = x @ (q * scale[:, None]).T (+ bias)``; ``q`` int8 ``[out, in]``, ``scale`` ``[out]``."""

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
        dense = dense_dtype(x.numel() // self.in_features, x.dtype)
        if dense == torch.float32:  # a prefill chunk off native bf16 / fp32 activations: one fp32
            # GEMM beats the kernel's per-row cost (EPYC, 1,536 x 576 at 512 bf16 rows: 7.1 vs 16 ms);
            # with native bf16 the kernel stays (not measured against a dense bf16 copy there)
            return _dense(x, self.dequantized_weight(dense), self.bias)
        scale = self.scale if self.scale.dtype == x.dtype else self.scale.to(x.dtype)
        if x.dim() == 2:  # the own forward's [T, in]: no reshapes (a decode step is mostly small calls)
            y = torch._weight_int8pack_mm(x, self.qweight, scale)
        else:
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, scale)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel={self.use_kernel}"


def _int4_codes(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min-max 4-bit codes of ``w [out, in]``: ``(q int32 [out, in] in 0..15, scale, zero)``,
    scale and zero ``[out, in/group]`` fp32, with ``w ~= (q - 8) * scale + zero``."""
    n, k = w.shape
    wg = w.float().view(n, k // group, group)
    lo, hi = wg.amin(dim=-1, keepdim=True), wg.amax(dim=-1, keepdim=True)
    scale = ((hi - lo) / 15.0).clamp(min=1e-10)  # [out, groups, 1]
    q = torch.round((wg - lo) / scale).clamp(0, 15).to(torch.int32).view(n, k)
    return q, scale.view(n, -1), (lo + 8.0 * scale).view(n, -1)


class Int4Linear(nn.Module):
    """Group-wise 4-bit weights (``INT4_GROUP`` input channels per scale/zero).

    CPU: packed by ``_convert_weight_to_int4pack_for_cpu`` and multiplied by
    ``_weight_int4pack_mm_for_cpu``. Elsewhere (or ``out % 16 != 0``): two codes per uint8,
    dequantized on the fly.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype,
                 group: int = INT4_GROUP) -> None:
        super().__init__()
        n, k = weight.shape
        if k % group:
            raise ValueError(f"in_features {k} is not a multiple of the int4 group {group}")
        self.in_features, self.out_features, self.group = k, n, group
        q, scale, zero = _int4_codes(weight.detach(), group)
        self.use_kernel = weight.device.type == "cpu" and n % 16 == 0
        if self.use_kernel:
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
        (AVX512, AVX2 and the default kernels differ): ``_int4_pack_order`` reads it off probe
        packs, so the unpack is the kernel's on any of them."""
        n, k, g = self.out_features, self.in_features, self.group
        layout = _int4_pack_layout(k)
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
            q = nibbles[:, _int4_pack_order(k)].view(n, k // g, g)  # [n, groups, g] codes 0..15
        scale = self.scale_zero[..., 0].float()  # [groups, n]
        low = (self.scale_zero[..., 1].float() - 8 * scale).t().unsqueeze(-1).to(dtype).contiguous()  # [n, groups, 1]
        return torch.addcmul(low, q.to(dtype), scale.t().unsqueeze(-1).to(dtype).contiguous()).view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_kernel:
            return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)
        dense = dense_dtype(x.numel() // self.in_features, x.dtype)
        if dense is not None and self.out_features % INT4_PACK_ROWS == 0:
            # a prefill chunk: the kernel's cost grows with rows (it decodes the codes per row
            # block), one dense GEMM over a transient dequantized copy does not
            return _dense(x, self.unpacked_weight(dense), self.bias)
        sz = self.scale_zero if self.scale_zero.dtype == x.dtype else self.scale_zero.to(x.dtype)
        if x.dim() == 2:  # the own forward's [T, in]: no reshapes
            y = torch._weight_int4pack_mm_for_cpu(x, self.qweight, self.group, sz)
        else:
            y = torch._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features), self.qweight, self.group, sz)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, group={self.group}, kernel={self.use_kernel}"


class Int8Embedding(nn.Module):
    """Token embedding as int8 rows with one scale per ``group`` columns (a GGUF Q8_0 block).

    ``embed_scale`` (Gemma's scaled embedding: rows times sqrt(hidden)) multiplies the rows.
    """

    def __init__(self, weight: torch.Tensor, act_dtype: torch.dtype, group: int = EMBED_GROUP,
                 embed_scale: torch.Tensor | float | None = None) -> None:
        super().__init__()
        v, d = weight.shape
        self.group = group if d % group == 0 else d
        wg = weight.detach().float().view(v, d // self.group, self.group)
        scale = (wg.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-10)  # [V, groups, 1]
        self.num_embeddings, self.embedding_dim = v, d
        self.register_buffer("qweight", torch.round(wg / scale).clamp(-127, 127).to(torch.int8).view(v, d))
        self.register_buffer("scale", scale.to(act_dtype))
        self.embed_scale = None if embed_scale is None else float(embed_scale)

    def dequantized_weight(self) -> torch.Tensor:
        v, d, g = self.num_embeddings, self.embedding_dim, self.group
        return (self.qweight.view(v, d // g, g).to(self.scale.dtype) * self.scale).view(v, d)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        g = self.group
        rows = self.qweight[ids].view(*ids.shape, self.embedding_dim // g, g)  # [..., groups, g] int8
        out = (rows.to(self.scale.dtype) * self.scale[ids]).view(*ids.shape, self.embedding_dim)
        return out if self.embed_scale is None else out * self.embed_scale


# --------------------------------------------------------------------------- fused projections

INT4_PACK_ROWS = 64  # the CPU int4 pack interleaves rows in blocks of 64: row slices at multiples stay packs


@lru_cache(maxsize=16)
def _int4_pack_order(k: int) -> torch.Tensor:
    """For one ``INT4_PACK_ROWS`` x ``k`` block of the CPU int4 pack, the nibble (low then high
    nibble of each byte) holding each code, in ``[row, k]`` order: ``nibbles[order]`` are the
    block's codes row-major. Read off packs of probes whose codes are the base-16 digits of each
    code's own index (the layout depends on the CPU capability torch dispatches to)."""
    size = INT4_PACK_ROWS * k
    index = torch.arange(size, dtype=torch.int64)
    where = torch.zeros(size, dtype=torch.int64)  # nibble position -> code index
    shift = 0
    while (1 << shift) < size:
        probe = ((index >> shift) & 0xF).to(torch.int32).view(INT4_PACK_ROWS, k)
        packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1).view(-1)
        where |= torch.stack([packed & 0xF, packed >> 4], dim=-1).view(-1).to(torch.int64) << shift
        shift += 4
    order = torch.empty(size, dtype=torch.int64)
    order[where] = index
    if not torch.equal(torch.sort(where).values, index):
        raise RuntimeError("unexpected CPU int4 pack layout: not a permutation of its codes")
    return order


@lru_cache(maxsize=16)
def _int4_pack_layout(k: int) -> str:
    """Which known order the pack uses for ``k`` input channels, read off ``_int4_pack_order``:
    ``avx512`` (byte ``[k, j]`` of a block: row ``j`` low nibble, ``j + 32`` high), ``avx2``
    (byte ``[half, k, j]``: row ``32 half + j`` low, ``32 half + 16 + j`` high), or ``other``
    (``Int4Linear.unpacked_weight`` then gathers by the order instead of reshaping)."""
    rows = (torch.arange(INT4_PACK_ROWS)[:, None] * k + torch.arange(k)[None, :])  # code index [row, k]
    half = INT4_PACK_ROWS // 2
    avx512 = torch.stack([rows[:half].t(), rows[half:].t()], dim=-1)  # [k, j, nibble] -> code index
    avx2 = rows.view(2, 2, 16, k).permute(0, 3, 2, 1)  # [half, k, j, nibble] -> code index
    arange = torch.arange(INT4_PACK_ROWS * k)
    order = _int4_pack_order(k)
    for name, nibbles in (("avx512", avx512), ("avx2", avx2)):
        if torch.equal(order[nibbles.reshape(-1)], arange):
            return name
    return "other"


def fuse_linears(layers: list[nn.Module]) -> nn.Module | None:
    """One layer computing ``cat([layer(x) for layer in layers], -1)`` in one matmul (q/k/v,
    gate/up of a decoder layer: a decode step is many small calls), or None when they cannot
    share one: different types, input sizes, dtypes or kernels, a bias, or an int4 part whose
    rows do not start on a pack block.

    The codes or weights are concatenated exactly (every scheme here is row-local), so the
    fused layer computes what the parts compute; the parts are then rebound to row views of
    the fused storage, so the model's own forward keeps working and no weight is held twice."""
    first = layers[0]
    kind = type(first)
    if kind not in (nn.Linear, Int8Linear, Int4Linear) or any(type(m) is not kind for m in layers):
        return None
    if any(m.bias is not None or m.in_features != first.in_features for m in layers):
        return None
    if kind is nn.Linear:
        if len({(m.weight.dtype, m.weight.device) for m in layers}) != 1:
            return None
        fused = nn.Linear(first.in_features, sum(m.out_features for m in layers), bias=False,
                          device=first.weight.device, dtype=first.weight.dtype)
        fused.weight = nn.Parameter(torch.cat([m.weight.detach() for m in layers]), requires_grad=False)
        for m, rows in zip(layers, _row_spans(layers)):
            m.weight = nn.Parameter(fused.weight.detach()[rows], requires_grad=False)
        return fused
    if len({(m.use_kernel, _buffer_dtype(m)) for m in layers}) != 1:
        return None
    fused = kind.__new__(kind)
    nn.Module.__init__(fused)
    fused.in_features, fused.out_features = first.in_features, sum(m.out_features for m in layers)
    fused.use_kernel = first.use_kernel
    if kind is Int8Linear:
        fused.register_buffer("qweight", torch.cat([m.qweight for m in layers]))  # [out, in] int8
        fused.register_buffer("scale", torch.cat([m.scale for m in layers]))  # [out]
    else:
        if first.use_kernel and any(m.out_features % INT4_PACK_ROWS for m in layers):
            return None
        fused.group = first.group
        fused.register_buffer("qweight", torch.cat([m.qweight for m in layers]))  # packed rows, or [out, in/2]
        # (scale, zero): [in/group, out, 2] for the kernel, [out, groups, 2] unpacked
        fused.register_buffer("scale_zero", torch.cat([m.scale_zero for m in layers], dim=1 if first.use_kernel else 0))
    fused.register_buffer("bias", None)
    for m, rows in zip(layers, _row_spans(layers)):
        m.qweight = fused.qweight[rows]  # a view: the codes are stored once (scales stay the part's own)
    return fused


def fused_projection(owner: nn.Module, names: tuple[str, ...]) -> nn.Module | None:
    """``fuse_linears`` of ``owner``'s sub-layers ``names``, made once per owner: kept on the
    owner (not as a registered sub-module: ``state_dict`` and ``.to()`` see only the parts)
    and reused while the parts are still views of it, so several runners over one model
    share one fused copy. None when the parts cannot be fused."""
    key = "_kvreuse_fused_" + "_".join(names)
    parts = [getattr(owner, n) for n in names]
    fused = owner.__dict__.get(key)
    if fused is None or not all(_storage(m) == _storage(fused) and _weight(m).dtype == _weight(fused).dtype
                                for m in parts):
        fused = fuse_linears(parts)
        object.__setattr__(owner, key, fused)  # bypasses nn.Module registration on purpose
    return fused


def _weight(m: nn.Module) -> torch.Tensor:
    return m.weight if isinstance(m, nn.Linear) else m.qweight


def _storage(m: nn.Module | None) -> int | None:
    return None if m is None else _weight(m).untyped_storage().data_ptr()


def _row_spans(layers: list[nn.Module]) -> list[slice]:
    spans, start = [], 0
    for m in layers:
        spans.append(slice(start, start + m.out_features))
        start += m.out_features
    return spans


def _buffer_dtype(m: nn.Module) -> torch.dtype:
    return m.scale.dtype if isinstance(m, Int8Linear) else m.scale_zero.dtype


# --------------------------------------------------------------------------- model surgery

def _quantized_linear(linear: nn.Linear, mode: QuantMode, act_dtype: torch.dtype) -> nn.Module:
    if mode is QuantMode.INT4 and linear.in_features % INT4_GROUP == 0:
        return Int4Linear(linear.weight, linear.bias, act_dtype)
    return Int8Linear(linear.weight, linear.bias, act_dtype)


def quantize_model(model: nn.Module, mode: str | QuantMode, *, act_dtype: torch.dtype) -> nn.Module:
    """Replace, in place, every ``nn.Linear`` of ``model`` by its quantized form.

    Linear layers take ``mode`` (int4 falls back to int8 where ``in_features`` is not a multiple
    of 32); the output projection (``lm_head``) takes int8 per channel in both modes (its
    weight is usually the tied embedding, a Q8_0 tensor in GGUFs, and 4-bit there costs quality
    for little speed); the input embedding, a plain ``nn.Embedding`` or Gemma's scaled one
    (``embed_scale``), becomes :class:`Int8Embedding`; other embeddings are kept. Scales are stored in
    ``act_dtype``; call this on the model's device before casting it to ``act_dtype``, with the
    weights still fp32 so the codes are computed from full-precision values.
    Returns ``model``. ``mode`` none returns ``model`` untouched.
    """
    mode = parse_quantization(mode)
    if mode is QuantMode.NONE:
        return model
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        layer_mode = QuantMode.INT8 if linear is out_emb else mode
        _set_module(model, name, _quantized_linear(linear, layer_mode, act_dtype))
    if type(in_emb) is nn.Embedding or (isinstance(in_emb, nn.Embedding) and hasattr(in_emb, "embed_scale")):
        model.set_input_embeddings(Int8Embedding(in_emb.weight, act_dtype, embed_scale=getattr(in_emb, "embed_scale", None)))
    return model


def _set_module(root: nn.Module, dotted: str, new: nn.Module) -> None:
    parent_name, _, child = dotted.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer storage of ``model`` (tied weights once)."""
    seen: dict[int, int] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
