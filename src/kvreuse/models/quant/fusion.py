"""Fused projections: several linear layers over one input (q/k/v, gate/up) as one matmul."""

from __future__ import annotations

import torch
from torch import nn

from kvreuse.models.quant.int4_linear import Int4Linear
from kvreuse.models.quant.int4_pack import INT4_PACK_ROWS
from kvreuse.models.quant.int8_linear import Int8Linear

__all__ = ["fuse_linears", "fused_projection"]


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
