"""``Q6KLinear``: a GGUF Q6_K tensor kept as the file's own blocks (6.5625 bits a weight) on
kvreuse's 6-bit kernel, ``w = d * scale * (code - 32)``: 16 weights per int8 scale, 256 per
float16 ``d``.

Why: llama.cpp stores the output projection of most 4- and 5-bit files as Q6_K. Requantized to
int8 per channel (what other layers of such a file get) it is off the file's values and reads 22%
more bytes every decode step (the 1B bench model's: 100.7 MB against the file's 82.6 MB), on the
step's largest single matrix. Built only from the file's blocks, and only where they dequantize
to exactly the weight the model loaded (the same tensor, read back the same way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.models.kernels import native_kernels
from kvreuse.models.kernels.packing import pack_q6, q6_packable, unpack_q6

__all__ = ["Q6KLinear", "q6k_fields", "dequantize_q6k", "BLOCK_BYTES", "NATIVE_MAX_ROWS"]

BLOCK_BYTES = 210  # llama.cpp's block_q6_K: ql[128], qh[64], scales[16] int8, d float16; 256 weights
NATIVE_MAX_ROWS = 32  # as Int8Linear: from here one dense product over a dequantized copy


def q6k_fields(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K rows ``blocks [N, K/256 * 210]`` uint8 -> ``(codes [N, K] uint8 0..63, scale [N, K/16]
    int8, d [N, K/256] float16)``, weight ``k`` of a block being ``d * scale[k / 16] * (code - 32)``
    (llama.cpp's ``dequantize_row_q6_K``: weight ``128 j + 32 s + l`` takes the low nibble
    ``s / 2`` of ``ql[64 j + 32 (s % 2) + l]`` and bits ``2 s`` of ``qh[32 j + l]``).
    Raises ValueError when the row length is not whole blocks."""
    n, width = blocks.shape
    if width % BLOCK_BYTES:
        raise ValueError(f"Q6_K rows are whole {BLOCK_BYTES}-byte blocks, got {width} bytes")
    nb = width // BLOCK_BYTES
    b = blocks.reshape(n, nb, BLOCK_BYTES)
    ql = b[..., :128].reshape(n, nb, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)  # [.., j, nib, 64]
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    codes = (ql & 0xF).reshape(n, nb, 256) | ((qh & 3).reshape(n, nb, 256) << 4)
    scale = b[..., 192:208].contiguous().view(torch.int8).reshape(n, nb * 16)
    d = b[..., 208:210].contiguous().view(torch.float16).reshape(n, nb)
    return codes.reshape(n, nb * 256), scale, d


def dequantize_q6k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K rows ``blocks [N, K/256 * 210]`` -> ``[N, K]`` float32, as gguf-py (and so transformers'
    GGUF loading) dequantizes them."""
    return _dequantize(*q6k_fields(blocks))


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` float32 as gguf-py dequantizes Q6_K: ``(d * scale) * (code - 32)``, each in fp32."""
    n, k = codes.shape
    ds = d.float().repeat_interleave(16, dim=1) * scale.float()  # [N, K/16], exact
    return (ds.unsqueeze(-1) * (codes.view(n, k // 16, 16).float() - 32)).view(n, k)


class Q6KLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` a GGUF Q6_K tensor's blocks, on ``q6_linear`` for
    fewer than ``NATIVE_MAX_ROWS`` rows (each row alone: batch-invariant), else over a transient
    dequantized copy. Exists only where kvreuse's kernels are built (``from_gguf_blocks``)."""

    native = True  # kvreuse's layout and kernel (invariant.project, kernels_in_use)
    qweight: torch.Tensor  # [out/16, in/32, 384] uint8
    scales: torch.Tensor  # [out/16, in/32, 2, 16] int8
    d_bits: torch.Tensor  # [out/16, in/256, 16] float16 bits as int16 (a module's .to(dtype) leaves it)
    bias: torch.Tensor | None  # [out]

    def __init__(self, blocks: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype) -> None:
        """``blocks [out, in/256 * 210]`` uint8. Raises ValueError for a shape the layout cannot hold."""
        super().__init__()
        codes, scale, d = q6k_fields(blocks)
        self.out_features, self.in_features = codes.shape
        qweight, sc, dd = pack_q6(codes, scale, d)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", sc)
        self.register_buffer("d_bits", dd.view(torch.int16))
        self.register_buffer("bias", None if bias is None else bias.detach().to(act_dtype))

    @classmethod
    def from_gguf_blocks(
        cls, blocks: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act_dtype: torch.dtype
    ) -> Q6KLinear | None:
        """The layer for ``weight [out, in]`` from its file's Q6_K ``blocks``, or None when the
        kernels are not built, the shape does not fit the layout, or the blocks do not
        dequantize to exactly ``weight`` (not this tensor, or not read back as the file holds it)."""
        n, k = weight.shape
        if native_kernels() is None or weight.device.type != "cpu" or not q6_packable(n, k):
            return None
        if blocks.dtype != torch.uint8 or blocks.shape != (n, k // 256 * BLOCK_BYTES):
            return None
        if not torch.equal(dequantize_q6k(blocks), weight.detach().float()):
            return None
        return cls(blocks, bias, act_dtype)

    def dequantized_weight(self) -> torch.Tensor:
        """``[out, in]`` float32: the file's values exactly."""
        return _dequantize(*unpack_q6(self.qweight, self.scales, self.d_bits))

    def native_linear(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]`` (contiguous, bf16 / fp32) -> ``[T, out]``, each row computed alone."""
        y = torch.ops.kvreuse.q6_linear(x, self.qweight, self.scales, self.d_bits)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows >= NATIVE_MAX_ROWS:
            return F.linear(x, self.dequantized_weight().to(x.dtype), self.bias)
        y = self.native_linear(x.reshape(-1, self.in_features).contiguous())
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernel=kvreuse-q6_k"
