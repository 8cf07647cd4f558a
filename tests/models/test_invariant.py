"""Batch-invariant projections (kvreuse.models.invariant): a row's output is the same bits
whether it is computed alone, among 37 rows or among 300, for every layer kind the default
model uses (int4 and int8 kernels, dense fp32 / bf16), and close to the layer's own output."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvreuse.models import invariant
from kvreuse.models.quant import Int4Linear, Int8Linear

ROWS = (1, 2, 7, 8, 9, 10, 11, 12, 16, 37, 300)  # 9-11: where fp32 sgemm changed kernels again


def _weight(out_features: int, in_features: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0)) * 0.05


def _rows(n: int, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(n, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)  # [n, in]


def _layer(kind: str, dtype: torch.dtype) -> nn.Module:
    w = _weight(1536, 576)  # SmolLM2's gate/up shape
    if kind == "int4":
        return Int4Linear(w, None, dtype)
    if kind == "int8":
        return Int8Linear(w, None, dtype)
    dense = nn.Linear(576, 1536, bias=False)
    dense.weight = nn.Parameter(w.to(dtype), requires_grad=False)
    return dense


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["int4", "int8", "dense"])
def test_project_rows_are_bitwise_equal_at_any_row_count(kind, dtype):
    layer = _layer(kind, dtype)
    x = _rows(300, 576, dtype)
    with torch.inference_mode():
        full = invariant.project(layer, x)  # [300, out]
        for m in ROWS:
            assert torch.equal(invariant.project(layer, x[:m]), full[:m]), f"{m} rows"
        alone = torch.cat([invariant.project(layer, x[i : i + 1]) for i in (0, 36, 299)])
        assert torch.equal(alone, full[[0, 36, 299]])


@pytest.mark.parametrize("kind", ["int4", "int8", "dense"])
def test_project_computes_the_layer(kind):
    layer = _layer(kind, torch.float32)
    x = _rows(37, 576, torch.float32)
    with torch.inference_mode():
        torch.testing.assert_close(invariant.project(layer, x), layer(x), rtol=1e-4, atol=1e-4)


def test_the_fast_int4_path_is_not_row_invariant_which_is_why_this_exists():
    # the layer's own forward multiplies a dequantized bf16 copy from DENSE_MIN_ROWS rows: the
    # first rows of a 300-row call differ from the same rows alone (the failure of issue 31)
    layer = _layer("int4", torch.bfloat16)
    x = _rows(300, 576, torch.bfloat16)
    with torch.inference_mode():
        assert not torch.equal(layer(x[:1]), layer(x)[:1])


def test_concatenated_parts_and_rms_norm_are_row_invariant():
    class Parts:
        parts = (_layer("int4", torch.bfloat16), _layer("int8", torch.bfloat16))

    x = _rows(300, 576, torch.bfloat16)
    w = torch.rand(576).bfloat16()
    with torch.inference_mode():
        full = invariant.project(Parts(), x)  # [300, 2 * 1536]
        assert full.shape == (300, 3072)
        assert torch.equal(invariant.project(Parts(), x[:1]), full[:1])
        norm = invariant.rms_norm(x, w, 1e-5)
        assert torch.equal(invariant.rms_norm(x[:1], w, 1e-5), norm[:1])
        assert torch.equal(invariant.rms_norm(x[:37], w, 1e-5), norm[:37])
        torch.testing.assert_close(norm, F.rms_norm(x.float(), (576,), w.float(), 1e-5).bfloat16())


def test_dense_pads_few_rows_and_returns_only_the_real_ones():
    x = _rows(3, 16, torch.float32)
    w = _weight(8, 16)
    y = invariant.dense(x, w, torch.ones(8))
    assert y.shape == (3, 8)
    torch.testing.assert_close(y, x @ w.T + 1)
