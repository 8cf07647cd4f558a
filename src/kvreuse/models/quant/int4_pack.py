"""The CPU int4 pack's layout (``torch._convert_weight_to_int4pack_for_cpu``), read off probe
packs: which nibble of the packed weight holds each code. It depends on the CPU capability
torch dispatches to (AVX512, AVX2 and the default kernels differ)."""

from __future__ import annotations

from functools import lru_cache

import torch

__all__ = ["INT4_PACK_ROWS", "int4_pack_order", "int4_pack_layout"]

INT4_PACK_ROWS = 64  # the CPU int4 pack interleaves rows in blocks of 64: row slices at multiples stay packs


@lru_cache(maxsize=16)
def int4_pack_order(k: int) -> torch.Tensor:
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
def int4_pack_layout(k: int) -> str:
    """Which known order the pack uses for ``k`` input channels, read off ``int4_pack_order``:
    ``avx512`` (byte ``[k, j]`` of a block: row ``j`` low nibble, ``j + 32`` high), ``avx2``
    (byte ``[half, k, j]``: row ``32 half + j`` low, ``32 half + 16 + j`` high), or ``other``
    (``Int4Linear.unpacked_weight`` then gathers by the order instead of reshaping)."""
    rows = torch.arange(INT4_PACK_ROWS)[:, None] * k + torch.arange(k)[None, :]  # code index [row, k]
    half = INT4_PACK_ROWS // 2
    avx512 = torch.stack([rows[:half].t(), rows[half:].t()], dim=-1)  # [k, j, nibble] -> code index
    avx2 = rows.view(2, 2, 16, k).permute(0, 3, 2, 1)  # [half, k, j, nibble] -> code index
    arange = torch.arange(INT4_PACK_ROWS * k)
    order = int4_pack_order(k)
    for name, nibbles in (("avx512", avx512), ("avx2", avx2)):
        if torch.equal(order[nibbles.reshape(-1)], arange):
            return name
    return "other"
