"""Fused projections: several linear layers over one input (q/k/v, gate/up) as one matmul."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from kvreuse.models import huge_pages
from kvreuse.models.kernels.packing import ROWS
from kvreuse.models.quant.int4_linear import Int4Linear
from kvreuse.models.quant.int4_pack import INT4_PACK_ROWS
from kvreuse.models.quant.int8_linear import Int8Linear

__all__ = ["Projection", "fuse_linears", "fused_projection"]

Projection = nn.Linear | Int8Linear | Int4Linear  # the layers fuse_linears fuses (exact types)


def fuse_linears(layers: Sequence[nn.Module]) -> Projection | None:
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
    # every part an nn.Linear, or every part an Int8Linear, or every part an Int4Linear: checked above
    parts = cast("list[Projection]", list(layers))
    if any(m.bias is not None or m.in_features != parts[0].in_features for m in parts):
        return None
    if kind is nn.Linear:
        dense = cast("list[nn.Linear]", parts)
        if len({(m.weight.dtype, m.weight.device) for m in dense}) != 1:
            return None
        fused_dense = nn.Linear(
            dense[0].in_features,
            sum(m.out_features for m in dense),
            bias=False,
            device=dense[0].weight.device,
            dtype=dense[0].weight.dtype,
        )
        fused_dense.weight = nn.Parameter(torch.cat([m.weight.detach() for m in dense]), requires_grad=False)
        for part, rows in zip(dense, _row_spans(dense)):
            part.weight = nn.Parameter(fused_dense.weight.detach()[rows], requires_grad=False)
        return fused_dense
    quantized = cast("list[Int8Linear | Int4Linear]", parts)
    if len({(m.use_kernel, m.native, _buffer_dtype(m)) for m in quantized}) != 1:
        return None
    fused = cast("Int8Linear | Int4Linear", kind.__new__(kind))
    nn.Module.__init__(fused)
    fused.in_features, fused.out_features = quantized[0].in_features, sum(m.out_features for m in quantized)
    fused.use_kernel, fused.native = quantized[0].use_kernel, quantized[0].native
    # the native layouts hold rows in blocks of ROWS: qweight's dim 0 counts blocks
    per_row = ROWS if fused.native else 1
    if isinstance(fused, Int8Linear):
        int8 = cast("list[Int8Linear]", quantized)
        fused.q8_unsigned = int8[0].q8_unsigned
        fused.register_buffer("qweight", torch.cat([m.qweight for m in int8]))  # [out, in] int8 or blocks
        fused.register_buffer("scale", torch.cat([m.scale for m in int8]))  # [out]
        if fused.native:
            fused.register_buffer("scale_bits", torch.cat([m.scale_bits for m in int8]))  # [out]
    else:
        int4 = cast("list[Int4Linear]", quantized)
        if int4[0].use_kernel and not int4[0].native and any(m.out_features % INT4_PACK_ROWS for m in int4):
            return None
        fused.group, fused.act_dtype = int4[0].group, int4[0].act_dtype
        fused.register_buffer("qweight", torch.cat([m.qweight for m in int4]))  # packed rows, or [out, in/2]
        # (scale, zero): [2, out/16, in/32, 16] native, [in/group, out, 2] for torch's kernel, [out, groups, 2] unpacked
        dim = 1 if int4[0].use_kernel else 0
        if fused.native:  # symmetric parts keep one plane; beside an asymmetric one their mins are written out
            planes = max(m.scale_zero.size(0) for m in int4)
            fused.register_buffer("scale_zero", torch.cat([m.native_planes(planes) for m in int4], dim=1))
        else:
            fused.register_buffer("scale_zero", torch.cat([m.scale_zero for m in int4], dim=dim))
        if fused.native:
            fused.bind_native_scales()
    fused.register_buffer("bias", None)
    huge_pages.collapse([fused.qweight])  # a new allocation: a decode step streams it
    for m, rows in zip(quantized, _row_spans(quantized)):
        # a view: the codes are stored once (scales stay the part's own)
        m.qweight = fused.qweight[rows.start // per_row : rows.stop // per_row]
    return fused


def fused_projection(owner: nn.Module, names: tuple[str, ...]) -> Projection | None:
    """``fuse_linears`` of ``owner``'s sub-layers ``names``, made once per owner: kept on the
    owner (not as a registered sub-module: ``state_dict`` and ``.to()`` see only the parts)
    and reused while the parts are still views of it, so several runners over one model
    share one fused copy. None when the parts cannot be fused."""
    key = "_kvreuse_fused_" + "_".join(names)
    parts = [getattr(owner, n) for n in names]
    fused = owner.__dict__.get(key)
    if fused is None or not all(
        _storage(m) == _storage(fused) and _weight(m).dtype == _weight(fused).dtype for m in parts
    ):
        fused = fuse_linears(parts)
        object.__setattr__(owner, key, fused)  # bypasses nn.Module registration on purpose
    return fused


def _weight(m: Projection) -> torch.Tensor:
    return m.weight if isinstance(m, nn.Linear) else m.qweight


def _storage(m: Projection | None) -> int | None:
    return None if m is None else _weight(m).untyped_storage().data_ptr()


def _row_spans(layers: Sequence[Projection]) -> list[slice]:
    spans, start = [], 0
    for m in layers:
        spans.append(slice(start, start + m.out_features))
        start += m.out_features
    return spans


def _buffer_dtype(m: Int8Linear | Int4Linear) -> torch.dtype:
    return m.scale.dtype if isinstance(m, Int8Linear) else m.scale_zero.dtype
