"""``Int8Embedding``: a token embedding as int8 rows with one scale per group of columns."""

from __future__ import annotations

import torch
from torch import nn

from kvreuse.models.quant.mode import EMBED_GROUP

__all__ = ["Int8Embedding"]


class Int8Embedding(nn.Module):
    """Token embedding as int8 rows with one scale per ``group`` columns (a GGUF Q8_0 block).

    ``embed_scale`` (Gemma's scaled embedding: rows times sqrt(hidden)) multiplies the rows.
    """

    # buffers (register_buffer): declared so the type checker knows them
    qweight: torch.Tensor  # [vocab, hidden] int8
    scale: torch.Tensor  # one per group of columns, the activation dtype

    def __init__(
        self,
        weight: torch.Tensor,
        act_dtype: torch.dtype,
        group: int = EMBED_GROUP,
        embed_scale: torch.Tensor | float | None = None,
    ) -> None:
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
