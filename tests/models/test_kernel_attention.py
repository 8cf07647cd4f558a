"""kvreuse's attention kernels (models/kernels/attention.cpp): the causal chunk kernel computes
causal softmax attention, and a query row gets the same bits whatever shares its call: as one
row of a long chunk, as a short suffix, alone, and as a decode (``decode_attention``). Skipped
where the kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from kvreuse.models.kernels import native_kernels

KERNELS = native_kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="kvreuse's native kernels are not built on this machine")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention: token t of ``q [n, H, d]`` sees keys ``0 .. L - n + t`` of
    ``k, v [kv, L, d]``; head h uses kv head ``h // (H / kv)``. ``[n, H, d]``."""
    n, heads, _ = q.shape
    kv, length, _ = k.shape
    groups = heads // kv
    hidden = torch.arange(length)[None, :] > (length - n + torch.arange(n))[:, None]  # [n, L]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(heads):
        s = (q[:, h].double() @ k[h // groups].double().T * scale).masked_fill(hidden, float("-inf"))
        out[:, h] = torch.softmax(s, -1) @ v[h // groups].double()
    return out


def _inputs(n: int, length: int, heads: int, kv: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    q = torch.randn(n, heads, d, generator=_gen(seed)).bfloat16()
    k = torch.randn(kv, length, d, generator=_gen(seed + 1)).bfloat16()
    v = torch.randn(kv, length, d, generator=_gen(seed + 2)).bfloat16()
    return q, k, v


@pytest.mark.parametrize(
    "n, length, heads, kv, d",
    [(1, 1, 9, 3, 64), (5, 300, 9, 3, 64), (37, 37, 4, 2, 32), (300, 812, 9, 3, 64), (17, 513, 8, 8, 128)],
)
def test_causal_attention_is_causal_softmax_attention(n, length, heads, kv, d):
    """Within bf16 output rounding of float64 attention, for chunks that start at key 0, after a
    context, span several items of 256 keys and end mid-item."""
    q, k, v = _inputs(n, length, heads, kv, d, seed=n + length)
    out = torch.ops.kvreuse.causal_attention(q, k, v, d**-0.5)
    want = _reference(q, k, v, d**-0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert (out.double() - want).abs().max().item() <= 2**-8 * want.abs().max().item()


@pytest.mark.parametrize("n, length, heads, kv", [(70, 600, 9, 3), (33, 33, 32, 8)])
def test_a_token_gets_the_same_bits_alone_in_a_suffix_and_as_a_decode(n, length, heads, kv):
    """The batch-invariance contract: token t computed in the whole chunk, in a suffix of the
    chunk, alone over its keys, and by decode_attention (its query heads stacked, every key
    visible) gives identical bits."""
    d = 64
    q, k, v = _inputs(n, length, heads, kv, d, seed=7)
    whole = torch.ops.kvreuse.causal_attention(q, k, v, 0.125)
    suffix = torch.ops.kvreuse.causal_attention(q[n - 3 :], k, v, 0.125)
    assert torch.equal(suffix.view(torch.int16), whole[n - 3 :].view(torch.int16))
    for t in (0, 1, n // 2, n - 1):
        seen = length - n + t + 1
        alone = torch.ops.kvreuse.causal_attention(q[t : t + 1], k[:, :seen], v[:, :seen], 0.125)
        stacked = q[t].view(1, kv, heads // kv, d)  # [1, kv, groups, d]
        decode, _ = torch.ops.kvreuse.decode_attention(stacked, k[None, :, :seen], v[None, :, :seen], 0.125)
        assert torch.equal(alone[0].view(torch.int16), whole[t].view(torch.int16))
        assert torch.equal(decode.view(heads, d).view(torch.int16), whole[t].view(torch.int16))


@pytest.mark.parametrize("n, kv", [(16, 3), (40, 2), (3, 1)])
def test_a_short_chunk_split_by_items_gives_the_same_bits_on_any_threads(n, kv):
    """Few (KV head, 32-token) units: each unit's items run as separate tasks (with 2 threads or
    more) or a unit at a time (1 thread); the same bits either way, over a 1,500-key context."""
    q, k, v = _inputs(n, 1500, 3 * kv, kv, 64, seed=11)
    threads = torch.get_num_threads()
    try:
        outs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            outs.append(torch.ops.kvreuse.causal_attention(q, k, v, 0.125).view(torch.int16))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    want = _reference(q, k, v, 0.125)
    assert (outs[0].view(torch.bfloat16).double() - want).abs().max().item() <= 2**-8 * want.abs().max().item()


def test_causal_attention_reads_pool_views_and_int8_rows():
    """Keys read in place from a pool-shaped tensor ([kv, slots, d] sliced to a run) give the
    bits of a contiguous copy; an int8 pool's stored rows give the bits of their dequantization."""
    from kvreuse.engine.kv_quant import dequantize, quantize

    q = torch.randn(20, 6, 64, generator=_gen(40)).bfloat16()
    pool_k = torch.randn(3, 900, 64, generator=_gen(41)).bfloat16()
    pool_v = torch.randn(3, 900, 64, generator=_gen(42)).bfloat16()
    k, v = pool_k[:, 50:650], pool_v[:, 50:650]  # views [kv, 600, d]
    assert torch.equal(
        torch.ops.kvreuse.causal_attention(q, k, v, 0.125),
        torch.ops.kvreuse.causal_attention(q, k.contiguous(), v.contiguous(), 0.125),
    )
    qk, qv = quantize(pool_k.float())[:, 50:650], quantize(pool_v.float())[:, 50:650]  # [kv, 600, d + 2] uint8
    raw = torch.ops.kvreuse.causal_attention(q, qk, qv, 0.125)
    deq = torch.ops.kvreuse.causal_attention(q, dequantize(qk, torch.bfloat16), dequantize(qv, torch.bfloat16), 0.125)
    assert torch.equal(raw, deq)


def test_causal_attention_names_what_it_refuses():
    q, k, v = _inputs(4, 10, 6, 3, 64, seed=3)
    with pytest.raises(RuntimeError, match="n <= L"):
        torch.ops.kvreuse.causal_attention(torch.randn(11, 6, 64).bfloat16(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv"):
        torch.ops.kvreuse.causal_attention(torch.randn(4, 5, 64).bfloat16(), k, v, 0.125)
    with pytest.raises(RuntimeError, match="share one dtype"):
        torch.ops.kvreuse.causal_attention(q.float(), k, v, 0.125)
    for bad in (k[0, 0], k[0, 0, 0]):  # k of 1 or 0 dims: a RuntimeError, with or without slots
        for slots in (None, torch.tensor([0])):
            with pytest.raises(RuntimeError, match="k / v \\[kv, L, D\\]"):
                torch.ops.kvreuse.causal_attention(q, bad, bad, 0.125, slots)


def test_keys_read_by_slot_are_the_gathered_keys_bits():
    """With ``slots``, k / v are whole pool sides and key j is row slots[j] (a block table read in
    place): the bits of the same keys gathered first, for both ops, bf16 and int8 rows; a slot
    outside the pool is refused, naming it."""
    from kvreuse.engine.kv_quant import quantize

    pool_k = torch.randn(3, 900, 64, generator=_gen(50)).bfloat16()  # [kv, slots, d]
    pool_v = torch.randn(3, 900, 64, generator=_gen(51)).bfloat16()
    slots = torch.randperm(900, generator=_gen(52))[:600]  # [L] keys in attention order, anywhere in the pool
    q = torch.randn(20, 9, 64, generator=_gen(53)).bfloat16()
    stacked = torch.randn(1, 3, 3, 64, generator=_gen(54)).bfloat16()  # a decode's query heads
    for k, v in ((pool_k, pool_v), (quantize(pool_k.float()), quantize(pool_v.float()))):
        gk, gv = k.index_select(1, slots), v.index_select(1, slots)
        assert torch.equal(
            torch.ops.kvreuse.causal_attention(q, k, v, 0.125, slots),
            torch.ops.kvreuse.causal_attention(q, gk, gv, 0.125),
        )
        by_slot = torch.ops.kvreuse.decode_attention(stacked, k[None], v[None], 0.125, slots)
        gathered = torch.ops.kvreuse.decode_attention(stacked, gk[None], gv[None], 0.125)
        assert torch.equal(by_slot[0], gathered[0]) and torch.equal(by_slot[1], gathered[1])
    with pytest.raises(RuntimeError, match="slot 900 outside the 900 rows of k"):
        torch.ops.kvreuse.causal_attention(q, pool_k, pool_v, 0.125, torch.tensor([0, 5, 900]))


def test_a_nan_key_gives_nan_rows_and_empty_shapes_are_refused():
    """A NaN among the keys makes the rows that see it NaN (as float64 attention), on the vector
    exp as on the scalar one; no heads, no rows or no KV heads are refused, not a crash."""
    q, k, v = _inputs(4, 10, 6, 3, 64, seed=9)
    k[1, 5, 3] = float("nan")  # kv head 1, key 5: seen by tokens 1.. (L - n = 6: token t sees keys 0..6+t)
    out = torch.ops.kvreuse.causal_attention(q, k, v, 0.125)
    assert out[:, 2:4].isnan().all() and not out[:, :2].isnan().any() and not out[:, 4:].isnan().any()
    decode, lse = torch.ops.kvreuse.decode_attention(q[:1].view(1, 3, 2, 64), k[None], v[None], 0.125)
    assert decode[0, 1].isnan().all() and lse[0, 1].isnan().all() and not decode[0, 0].isnan().any()
    with pytest.raises(RuntimeError, match="no heads or no rows"):
        torch.ops.kvreuse.decode_attention(torch.randn(1, 3, 0, 64).bfloat16(), k[None], v[None], 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv"):
        torch.ops.kvreuse.causal_attention(q, k[:0], v[:0], 0.125)
    with pytest.raises(RuntimeError, match="multiple of kv"):
        torch.ops.kvreuse.causal_attention(q[:, :0], k, v, 0.125)
