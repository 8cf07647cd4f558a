"""Model surgery: replace a model's linear layers and input embedding by their quantized forms."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kvreuse.models.kernels import native_kernels
from kvreuse.models.quant.int4_linear import Int4Linear
from kvreuse.models.quant.int8_embedding import Int8Embedding
from kvreuse.models.quant.int8_linear import Int8Linear
from kvreuse.models.quant.mode import INT4_GROUP, QuantMode, parse_quantization
from kvreuse.models.quant.q6k_linear import Q6KLinear

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["quantize_model", "weight_bytes", "kernels_in_use", "kept_from_file"]


def _quantized_linear(linear: nn.Linear, mode: QuantMode, act_dtype: torch.dtype) -> nn.Module:
    if mode is QuantMode.INT4 and linear.in_features % INT4_GROUP == 0:
        return Int4Linear(linear.weight, linear.bias, act_dtype)
    return Int8Linear(linear.weight, linear.bias, act_dtype)


def quantize_model(
    model: PreTrainedModel,
    mode: str | QuantMode,
    *,
    act_dtype: torch.dtype,
    output_blocks: torch.Tensor | None = None,
) -> PreTrainedModel:
    """Replace, in place, every ``nn.Linear`` of ``model`` by its quantized form.

    Linear layers take ``mode`` (int4 falls back to int8 where ``in_features`` is not a multiple
    of 32); the output projection (``lm_head``) takes int8 per channel in both modes (its
    weight is usually the tied embedding, a Q8_0 tensor in GGUFs, and 4-bit there costs quality
    for little speed); the input embedding, a plain ``nn.Embedding`` or Gemma's scaled one
    (``embed_scale``), becomes :class:`Int8Embedding`; other embeddings are kept. Scales are stored in
    ``act_dtype``; call this on the model's device before casting it to ``act_dtype``, with the
    weights still fp32 so the codes are computed from full-precision values. ``output_blocks``:
    the GGUF's Q6_K blocks of the output projection; where they are exactly its weight and
    kvreuse's kernels are built, it keeps them (:class:`Q6KLinear`) instead of int8.
    Returns ``model``. ``mode`` none returns ``model`` untouched.
    """
    mode = parse_quantization(mode)
    if mode is QuantMode.NONE:
        return model
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    in_emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    for name, linear in targets:
        kept = None
        if linear is out_emb and output_blocks is not None:
            kept = Q6KLinear.from_gguf_blocks(output_blocks, linear.weight, linear.bias, act_dtype)
        layer_mode = QuantMode.INT8 if linear is out_emb else mode
        _set_module(model, name, kept if kept is not None else _quantized_linear(linear, layer_mode, act_dtype))
    if type(in_emb) is nn.Embedding or (isinstance(in_emb, nn.Embedding) and hasattr(in_emb, "embed_scale")):
        model.set_input_embeddings(
            Int8Embedding(in_emb.weight, act_dtype, embed_scale=getattr(in_emb, "embed_scale", None))
        )
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


def kernels_in_use(model: nn.Module) -> str:
    """Which kernels the quantized layers of ``model`` run on: ``kvreuse-<isa>`` when any holds
    kvreuse's native layout (``models/kernels``), else ``torch``. Printed at start-up; the model
    fingerprint folds in whether it is kvreuse's (the native kernels quantize activations to
    int8, so their KV differs), not the ISA."""
    if any(getattr(m, "native", False) for m in model.modules()):
        kernels = native_kernels()
        return f"kvreuse-{kernels.isa}" if kernels is not None else "kvreuse"
    return "torch"


def kept_from_file(model: nn.Module) -> list[str]:
    """The GGUF formats whose values ``model``'s layers keep as the file holds them (for the
    start-up line): ``Q4_0 codes`` (symmetric int4 layers), ``Q6_K output`` (:class:`Q6KLinear`)."""
    kept = []
    if any(isinstance(m, Int4Linear) and m.symmetric for m in model.modules()):
        kept.append("Q4_0 codes")
    if any(isinstance(m, Q6KLinear) for m in model.modules()):
        kept.append("Q6_K output")
    return kept
