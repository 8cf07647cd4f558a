"""Batch-invariant attention (kvreuse.engine.invariant_attention): a query's output is the
same bits whether it is one of a 1,459-token prefill, the 3-token suffix of a cached prompt, a
37-token chunk, or a decode alone; and it is causal attention (matches SDPA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvreuse.engine.invariant_attention import TILE, attend

HEADS, KV_HEADS, D = 9, 3, 64  # SmolLM2-135M's attention
LENGTH = 1459


def _qkv(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(LENGTH, HEADS, D, generator=g).to(dtype)  # [L, heads, d]
    k = torch.randn(KV_HEADS, LENGTH, D, generator=g).to(dtype)  # [kv, L, d]
    v = torch.randn(KV_HEADS, LENGTH, D, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_are_bitwise_equal_whatever_the_number_of_queries(dtype):
    q, k, v = _qkv(dtype)
    with torch.inference_mode():
        full = attend(q, k, v, 0.125)  # [L, heads, d]: a miss, the whole prompt in one call
        for n in (1, 3, 37, 300):  # the suffix of a cached prompt: n new tokens over L - n cached keys
            assert torch.equal(attend(q[-n:], k, v, 0.125), full[-n:]), f"suffix of {n}"
        for i in (0, 5, TILE - 1, TILE, 700, LENGTH - 1):  # a decode alone at position i
            assert torch.equal(attend(q[i : i + 1], k[:, : i + 1], v[:, : i + 1], 0.125), full[i : i + 1]), f"at {i}"
        # a chunk of a chunked prefill: queries 100..399 over keys 0..399
        assert torch.equal(attend(q[100:400], k[:, :400], v[:, :400], 0.125), full[100:400])


def test_it_is_causal_attention():
    q, k, v = _qkv(torch.float32)
    with torch.inference_mode():
        out = attend(q[-300:], k, v, 0.125)  # [300, heads, d]
        mask = torch.ones(300, LENGTH, dtype=torch.bool).tril_(LENGTH - 300)  # query i sees keys <= L - 300 + i
        ref = F.scaled_dot_product_attention(
            q[-300:].transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=0.125, enable_gqa=True
        )[0].transpose(0, 1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
