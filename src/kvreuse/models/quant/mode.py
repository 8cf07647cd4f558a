"""Quantization modes: the names ``--quantization`` accepts and the scheme each folds into the
model fingerprint."""

from __future__ import annotations

import enum

__all__ = ["QuantMode", "SCHEMES", "INT4_GROUP", "EMBED_GROUP", "parse_quantization"]

INT4_GROUP = 32  # input channels per (scale, zero) group; a GGUF Q4_1 / Q8_0 block
EMBED_GROUP = 32  # embedding columns per int8 scale; a GGUF Q8_0 block


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
