"""Weight layouts of kvreuse's native kernels (``gemv.cpp``): output rows interleaved in blocks
of 16 so one vector lane is one output row. Pure tensor functions, exact both ways.

- int4 (``q4_linear``): codes 0..15 with ``w = code * scale + min`` per group of 32 input
  channels (a GGUF Q4_1 block). ``qweight [N/16, K/32, 256]`` uint8, byte ``(p, r, i)`` of a
  group holding row ``r``'s code for input ``8p + i`` (low nibble) and ``8p + 4 + i`` (high);
  ``scale``, ``min`` ``[N/16, K/32, 16]`` float16. Symmetric groups (a GGUF Q4_0 block,
  ``w = (code - 8) * scale``) keep no min plane: ``min`` is empty and the kernels take
  ``-8 * scale`` (exact in float16), 4.5 bits a weight instead of 5.
- 6-bit (``q6_linear``, a GGUF Q6_K tensor): codes 0..63 with ``w = d * scale * (code - 32)``,
  one int8 ``scale`` per 16 inputs and one float16 ``d`` per 256. ``qweight [N/16, K/32, 384]``
  uint8: the codes' low nibbles in the int4 layout (bytes 0..255), then their high two bits,
  byte ``256 + 64 (p // 2) + 4 r + i`` holding those of inputs ``8p + i`` (bits ``4 (p % 2)``)
  and ``8p + 4 + i`` (bits ``4 (p % 2) + 2``); ``scale [N/16, K/32, 2, 16]`` int8 (row ``r``'s
  scale of the group's inputs 0..15, then 16..31); ``d [N/16, K/256, 16]`` float16.
- int8 (``q8_linear``): ``w = q * scale[row]``. ``qweight [N/16, K/4, 64]`` uint8, byte
  ``(c, r, i)`` holding row ``r``'s weight for input ``4c + i``, as ``q + 128`` for the VNNI
  kernel (``unsigned``) or as ``q``'s own byte otherwise; ``scale [N]`` float32.
"""

from __future__ import annotations

import torch

__all__ = [
    "ROWS",
    "GROUP",
    "pack_q4",
    "unpack_q4",
    "pack_q6",
    "unpack_q6",
    "pack_q8",
    "unpack_q8",
    "q4_packable",
    "q6_packable",
    "q8_packable",
]

ROWS = 16  # output rows per interleaved block
GROUP = 32  # input channels per scale
SUPER = 256  # input channels per 6-bit d (a GGUF K-quant super-block)


def q4_packable(out_features: int, in_features: int) -> bool:
    return out_features % ROWS == 0 and in_features % GROUP == 0


def q6_packable(out_features: int, in_features: int) -> bool:
    return out_features % ROWS == 0 and in_features % SUPER == 0


def q8_packable(out_features: int, in_features: int) -> bool:
    return out_features % ROWS == 0 and in_features % GROUP == 0


def pack_q4(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``codes [N, K]`` (0..15, any int dtype), ``scale`` / ``minimum [N, K/32]`` -> the kernel's
    ``(qweight, scale, min)``; ``minimum`` None: symmetric groups (``w = (code - 8) * scale``),
    ``min`` empty. Raises ValueError for a shape the layout cannot hold."""
    n, k = codes.shape
    if not q4_packable(n, k):
        raise ValueError(f"int4 pack needs out % {ROWS} == 0 and in % {GROUP} == 0, got [{n}, {k}]")
    mins = torch.empty(0, dtype=torch.float16) if minimum is None else _interleave(minimum, torch.float16)
    return _nibbles(codes), _interleave(scale, torch.float16), mins


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """The int4 layout of ``codes [N, K]``' low four bits: ``[N/16, K/32, 256]`` uint8."""
    n, k = codes.shape
    g = k // GROUP
    c = (codes.to(torch.uint8) & 0xF).view(n // ROWS, ROWS, g, 4, 2, 4)  # [b, r, g, p, half, i]
    c = c.permute(0, 2, 3, 1, 5, 4)  # [b, g, p, r, i, half]
    return (c[..., 0] | (c[..., 1] << 4)).reshape(n // ROWS, g, 256).contiguous()


def unpack_q4(
    qweight: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_q4`: ``(codes [N, K] uint8, scale [N, K/32], min [N, K/32])``
    (float16; ``scale`` / ``minimum`` may be given as their int16 bits; an empty ``minimum``
    unpacks as ``-8 * scale``, exact in float16)."""
    nb, g, _ = qweight.shape
    b = qweight.view(nb, g, 4, ROWS, 4)  # [b, g, p, r, i]
    c = torch.stack([b & 0xF, b >> 4], dim=-1)  # [b, g, p, r, i, half]
    codes = c.permute(0, 3, 1, 2, 5, 4).reshape(nb * ROWS, g * GROUP)
    d = _deinterleave(scale)
    return codes, d, -8 * d if minimum.numel() == 0 else _deinterleave(minimum)


def pack_q6(
    codes: torch.Tensor, scale: torch.Tensor, d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``codes [N, K]`` (0..63), ``scale [N, K/16]`` int8, ``d [N, K/256]`` -> the kernel's
    ``(qweight, scale, d float16)``. Raises ValueError for a shape the layout cannot hold."""
    n, k = codes.shape
    if not q6_packable(n, k):
        raise ValueError(f"6-bit pack needs out % {ROWS} == 0 and in % {SUPER} == 0, got [{n}, {k}]")
    g = k // GROUP
    h = (codes.to(torch.uint8) >> 4).view(n // ROWS, ROWS, g, 2, 2, 2, 4)  # [b, r, g, pp, pl, half, i]
    h = h.permute(0, 2, 3, 1, 6, 4, 5)  # [b, g, pp, r, i, pl, half]: bits 4 pl + 2 half of byte (pp, r, i)
    high = h[..., 0, 0] | (h[..., 0, 1] << 2) | (h[..., 1, 0] << 4) | (h[..., 1, 1] << 6)
    qweight = torch.cat([_nibbles(codes), high.reshape(n // ROWS, g, 128)], dim=2).contiguous()
    sc = scale.to(torch.int8).view(n // ROWS, ROWS, g, 2).permute(0, 2, 3, 1).contiguous()  # [b, g, 2, r]
    return qweight, sc, _interleave(d, torch.float16)


def unpack_q6(
    qweight: torch.Tensor, scale: torch.Tensor, d: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack_q6`: ``(codes [N, K] uint8, scale [N, K/16] int8, d [N, K/256]
    float16)`` (``d`` may be given as its int16 bits)."""
    nb, g, _ = qweight.shape
    b = qweight[..., :256].reshape(nb, g, 4, ROWS, 4)  # [b, g, p, r, i]
    low = torch.stack([b & 0xF, b >> 4], dim=-1)  # [b, g, p, r, i, half]
    hb = qweight[..., 256:].reshape(nb, g, 2, ROWS, 4)  # [b, g, pp, r, i]
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8)  # [pl, half]
    high = (hb[..., None, None] >> shifts) & 3  # [b, g, pp, r, i, pl, half]
    high = high.permute(0, 1, 2, 5, 3, 4, 6).reshape(nb, g, 4, ROWS, 4, 2)  # [b, g, p, r, i, half]
    c = low | (high << 4)
    codes = c.permute(0, 3, 1, 2, 5, 4).reshape(nb * ROWS, g * GROUP)
    sc = scale.view(nb, g, 2, ROWS).permute(0, 3, 1, 2).reshape(nb * ROWS, g * 2)
    return codes, sc, _deinterleave(d)


def pack_q8(q: torch.Tensor, scale: torch.Tensor, unsigned: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [N, K]`` int8, ``scale [N]`` -> the kernel's ``(qweight, scale float32)``."""
    n, k = q.shape
    if not q8_packable(n, k):
        raise ValueError(f"int8 pack needs out % {ROWS} == 0 and in % {GROUP} == 0, got [{n}, {k}]")
    b = q.to(torch.int8).view(n // ROWS, ROWS, k // 4, 4).permute(0, 2, 1, 3)  # [b, c, r, i]
    b = (b.to(torch.int16) + 128).to(torch.uint8) if unsigned else b.view(torch.uint8)
    return b.reshape(n // ROWS, k // 4, 64).contiguous(), scale.float().contiguous()


def unpack_q8(qweight: torch.Tensor, unsigned: bool) -> torch.Tensor:
    """Inverse of :func:`pack_q8`'s weights: ``q [N, K]`` int8."""
    nb, chunks, _ = qweight.shape
    b = qweight.view(nb, chunks, ROWS, 4).permute(0, 2, 1, 3).reshape(nb * ROWS, chunks * 4)
    return (b.to(torch.int16) - 128).to(torch.int8) if unsigned else b.view(torch.int8)


def _interleave(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n, g = t.shape  # [N, K/32] -> [N/16, K/32, 16]
    return t.to(dtype).view(n // ROWS, ROWS, g).transpose(1, 2).contiguous()


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int16:
        t = t.view(torch.float16)
    nb, g, _ = t.shape
    return t.transpose(1, 2).reshape(nb * ROWS, g)
