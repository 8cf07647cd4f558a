"""Moving cached keys to other RoPE positions: RoPE is a rotation, so a key computed at
position ``p`` becomes the key at ``p + delta`` by one more rotation of angle ``delta * theta_i``
per frequency pair (``R(p + delta) = R(delta) R(p)``). Values carry no position and stay.

::

    RopeShift.of(model)   per-layer inverse frequencies [layers, head_dim / 2], read once from the
                          model's own rotary module(s): Llama's ``rotary_emb.inv_freq`` (already
                          scaled for Llama-3 / linear / YaRN rope types), Gemma 3's two bases
                          (``sliding_attention_inv_freq`` for local layers, ``full_attention_inv_freq``
                          for global ones), chosen per layer by ``config.layer_types``
    shift.rotate(k, delta) k [layers, kv_heads, n, head_dim] at positions p -> the same keys at p + delta

The attention-scaling factor some rope types multiply into cos/sin (YaRN, LongRoPE) is already
inside the stored key once; the extra rotation is a pure rotation, so it is not applied again.
Rope types whose frequencies depend on the sequence length (``dynamic``) cannot be shifted:
``of`` raises ``ValueError`` naming the setting.

Sliding-window layers need nothing special here: a window masks keys by their RoPE position
(``attention.py``), and the shifted keys carry their new positions in the context's position
array. What the window does not undo is what every reuse of a document gives up: the document's
KV was computed attending to the text it was encoded after, not to what precedes it in the
request (blend, elsewhere, recomputes some tokens for that).

Pure torch; no pool, no engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_SHIFTABLE = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


@dataclass(frozen=True)
class RopeShift:
    """Per-layer RoPE frequencies of one model (rotate-half convention, as transformers)."""

    inv_freq: torch.Tensor  # [layers, head_dim / 2] fp32

    @classmethod
    def of(cls, model: PreTrainedModel) -> RopeShift:
        """The shift for a transformers ``*ForCausalLM`` (Llama family, Gemma 3). Raises
        ``ValueError`` for a rope type whose frequencies change with the length."""
        inner = getattr(model, "model", model)
        cfg = model.config
        rotary = cast("torch.nn.Module", inner.rotary_emb)  # the model's rotary embedding module
        layers = int(cfg.num_hidden_layers)
        layer_types = getattr(cfg, "layer_types", None)
        per_type = getattr(rotary, "rope_type", None)
        if isinstance(per_type, dict):  # Gemma 3: one rotary module, one frequency set per layer type
            for kind, rope in per_type.items():
                _check_type(rope, kind)
            assert layer_types is not None  # a rope per layer type (Gemma 3) comes with layer_types
            rows = [getattr(rotary, f"{t}_inv_freq") for t in layer_types]
        else:
            _check_type(per_type or "default", "rope")
            rows = [cast("torch.Tensor", rotary.inv_freq)] * layers  # a registered buffer
        return cls(torch.stack([r.detach().float().cpu() for r in rows]))  # [layers, d/2]

    def rotate(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """``keys`` ``[layers, kv_heads, n, head_dim]`` (any dtype/device) moved by ``delta``
        ``[n]`` int positions each; returns a new tensor of the same shape and dtype. Computed
        in fp32."""
        inv = self.inv_freq.to(keys.device)  # [L, d/2]
        # a document's tokens all move by one delta: the fp64 cos/sin once per distinct delta
        # (8 documents of 500 tokens: 9 of them instead of 4,063), gathered per token
        deltas, which = torch.unique(delta.to(keys.device), return_inverse=True)  # [u], [n]
        angle = deltas.double()[None, :, None] * inv.double()[:, None, :]  # [L, u, d/2]
        angle = torch.cat((angle, angle), dim=-1)  # [L, u, d]
        cos = angle.cos().float()[:, None, which]  # [L, 1, n, d]: broadcast over kv heads
        sin = angle.sin().float()[:, None, which]
        return rotate_by(keys, cos, sin)  # [L, kv_heads, n, d]


def rotate_by(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' rotate-half convention), computed in
    fp32, returned in ``x``'s dtype; ``cos``/``sin`` broadcast against ``x`` (last dim ``d``)."""
    k = x.float()
    half = k.shape[-1] // 2
    rotated = torch.cat((-k[..., half:], k[..., :half]), dim=-1)  # rotate_half(x)
    return (k * cos + rotated * sin).to(x.dtype)


def _check_type(rope_type: str, where: str) -> None:
    if rope_type not in _SHIFTABLE:
        raise ValueError(
            f"{where}: rope type {rope_type!r} changes its frequencies with the length, so cached "
            "keys cannot be moved to other positions; documents need a fixed-frequency rope type"
        )
