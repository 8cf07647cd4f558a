"""The fused attention over the pool (kvreuse.engine.attention): the flash kernel's
log-sum-exp contract, merging pieces, and every read path of a decode and of a suffix
(one run in place, several runs in place, gathered) against plain attention."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvreuse.engine import attention, flash
from kvreuse.engine.attention import ForwardContext, KeyTable, PrefillItem, attend


def _plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, num_new: int) -> torch.Tensor:
    """Reference: fp64 softmax attention of ``q [n, H, d]`` over ``k, v [L, kv, d]`` (GQA by
    repetition), the last ``num_new`` keys causal. Returns ``[n, H, d]``."""
    n, heads, _ = q.shape
    groups = heads // k.shape[1]
    kk, vv = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)  # [L, H, d]
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale  # [H, n, L]
    length = k.shape[0]
    future = torch.ones(n, num_new, dtype=torch.bool).triu(1)  # [n, num_new] True = not yet
    scores[..., length - num_new :] = scores[..., length - num_new :].masked_fill(future, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), vv)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_and_the_matmul_fallback_give_the_same_output_and_log_sum_exp(causal):
    # The fallback is what any other device runs: the same contract, checked here on CPU.
    g = torch.Generator().manual_seed(0)
    n = 5
    q = torch.randn(1, 6, n, 16, generator=g)  # [B, H, n, d], 3 query heads per kv head
    k, v = torch.randn(2, 1, 2, n if causal else 9, 16, generator=g)  # [B, kv, L, d]
    out, lse = flash.flash(q, k, v, 0.25, causal)
    ref_out, ref_lse = flash.math_attention(q, k, v, 0.25, causal)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    scores = torch.einsum("hnd,hld->hnl", q[0], k[0].repeat_interleave(3, 0)) * 0.25  # [H, n, L]
    if causal:
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse[0], torch.logsumexp(scores, -1), rtol=1e-5, atol=1e-5)


def test_merging_pieces_by_log_sum_exp_is_attention_over_their_union():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 3, 8, generator=g)  # [B, H, n, d]
    k, v = torch.randn(2, 1, 2, 20, 8, generator=g)  # [B, kv, L, d]
    whole = flash.flash(q, k, v, 0.3)[0]
    pieces = [flash.flash(q, k[:, :, a:b], v[:, :, a:b], 0.3) for a, b in ((0, 7), (7, 8), (8, 20))]
    torch.testing.assert_close(flash.merge(pieces), whole, rtol=1e-5, atol=1e-6)


def _context(new_slots: list[int], context_slots: list[int], runs: tuple, cache: torch.Tensor) -> ForwardContext:
    n = len(new_slots)
    keys = KeyTable(np.asarray(context_slots, np.int64), np.asarray(new_slots, np.int64), 1, n)
    length = len(context_slots) + n
    causal = torch.arange(length)[None, :] <= (torch.arange(n)[:, None] + len(context_slots))  # [n, L]
    item = PrefillItem(0, n, keys, causal, {}, runs)
    return ForwardContext(cache, torch.tensor(new_slots), [item], None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_new", [1, 6])
@pytest.mark.parametrize("layout", ["one run", "runs in place", "gathered"])
def test_every_read_path_attends_like_plain_attention(num_new, layout, dtype, monkeypatch):
    """A decode (1 new token) and a suffix (6) after 40 context keys, with the keys as one run
    of slots, as three long runs (read in place), or scattered (gathered): plain attention's
    result (fp32: 1e-5; bf16, whose decode over runs uses the flash kernel: 2e-2), and the new
    K/V written to their slots."""
    g = torch.Generator().manual_seed(2)
    monkeypatch.setattr(attention, "RUN_TOKENS_IN_PLACE", 4)  # these short runs count as long
    cache = torch.randn(2, 2, 2, 200, 16, generator=g).to(dtype)  # [layers, K/V, kv_heads, slots, d]
    if layout == "one run":
        context, new = list(range(10, 50)), list(range(50, 50 + num_new))
        runs = ((10, 40 + num_new),)
    elif layout == "runs in place":
        context, new = list(range(100, 120)) + list(range(0, 20)), list(range(150, 150 + num_new))
        runs = ((0, 20), (100, 20), (150, num_new))  # slot order, the new tokens last
    else:
        context = torch.randperm(140, generator=g)[:40].tolist()
        new = list(range(160, 160 + num_new))
        runs = ()  # too many runs: gathered
    q = torch.randn(num_new, 4, 16, generator=g).to(dtype)  # [n, heads, d]
    k, v = torch.randn(2, num_new, 2, 16, generator=g).to(dtype)  # [n, kv_heads, d]
    ctx = _context(new, context, runs, cache)
    keys_k = torch.cat([cache[1, 0, :, context].transpose(0, 1), k])  # [L, kv, d] before the write
    keys_v = torch.cat([cache[1, 1, :, context].transpose(0, 1), v])
    out = attend(1, q, k, v, ctx, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out, _plain(q, keys_k, keys_v, 0.25, num_new).to(dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(cache[1, 0, :, new].transpose(0, 1), k)  # written where the table says
    torch.testing.assert_close(cache[1, 1, :, new].transpose(0, 1), v)


def test_context_runs_drop_the_new_tokens_from_the_end():
    keys = KeyTable(np.zeros(0, np.int64), np.arange(8, dtype=np.int64), 1, 8)
    item = PrefillItem(0, 5, keys, None, {}, ((20, 4), (30, 2), (40, 2)))  # the last 5 keys are new
    assert item.context_runs == ((20, 3),)
    assert PrefillItem(0, 1, keys, None, {}, ()).context_runs == ()
