"""A GGUF Q6_K output projection kept as the file's blocks (quant/q6k_linear.py, kernels'
``q6_linear``): the fields are llama.cpp's, the layout round-trips, the kernel computes its
arithmetic with each row alone, the layer is built only from blocks that are exactly the weight,
and a model with one answers a hit as its miss. Skipped where the kernels cannot be built."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.models.kernels import native_kernels
from kvreuse.models.kernels.packing import pack_q6, unpack_q6
from kvreuse.models.quant import Int8Linear, Q6KLinear, kept_from_file
from kvreuse.models.quant.q6k_linear import BLOCK_BYTES, NATIVE_MAX_ROWS, dequantize_q6k, q6k_fields
from kvreuse.models.tiny import tiny_model

needs_kernels = pytest.mark.skipif(native_kernels() is None, reason="kvreuse's native kernels are not built here")


def _blocks(n: int, k: int, seed: int) -> torch.Tensor:
    """Random valid Q6_K rows ``[n, k / 256 * 210]`` (any bytes; a small positive or negative d)."""
    g = torch.Generator().manual_seed(seed)
    b = torch.randint(0, 256, (n, k // 256, BLOCK_BYTES), generator=g, dtype=torch.uint8)
    d = ((torch.rand(n, k // 256, 1, generator=g) - 0.3) * 1e-2).half()
    b[..., 208:] = d.view(torch.uint8)
    return b.view(n, -1)


def test_fields_dequantize_as_gguf_py_does():
    import gguf
    from gguf import quants

    blocks = _blocks(32, 512, 0)
    want = quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q6_K)
    assert torch.equal(dequantize_q6k(blocks), torch.from_numpy(np.ascontiguousarray(want)))
    codes, scale, d = q6k_fields(blocks)
    assert codes.shape == (32, 512) and int(codes.max()) <= 63 and scale.dtype == torch.int8 and d.shape == (32, 2)
    # weight 128 j + 32 s + l of a block: ql[64 j + 32 (s % 2) + l] nibble s // 2, qh[32 j + l] bits 2 s
    row, j, s, lo = 3, 1, 3, 5
    blk = blocks[row, BLOCK_BYTES : 2 * BLOCK_BYTES]  # the row's second block
    ql, qh = int(blk[64 * j + 32 * (s % 2) + lo]), int(blk[128 + 32 * j + lo])
    assert int(codes[row, 256 + 128 * j + 32 * s + lo]) == ((ql >> (4 * (s // 2))) & 0xF) | (((qh >> (2 * s)) & 3) << 4)
    assert int(scale[row, 16 + (128 * j + 32 * s + lo) // 16]) == int(
        blk[192 + (128 * j + 32 * s + lo) // 16].view(torch.int8)
    )
    with pytest.raises(ValueError, match="210-byte"):
        q6k_fields(blocks[:, :300])


def test_layout_round_trips_and_places_the_high_bits():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 64, (32, 512), generator=g)
    scale = torch.randint(-128, 128, (32, 32), generator=g).to(torch.int8)
    d = torch.rand(32, 2, generator=g)
    qweight, sc, dd = pack_q6(codes, scale, d)
    assert qweight.shape == (2, 16, 384) and sc.shape == (2, 16, 2, 16) and dd.shape == (2, 2, 16)
    b, r, grp, p, i = 1, 5, 3, 2, 1
    n, x = 16 * b + r, 32 * grp + 8 * p + i
    assert int(qweight[b, grp, 64 * p + 4 * r + i]) == (int(codes[n, x]) & 15) | ((int(codes[n, x + 4]) & 15) << 4)
    high = int(qweight[b, grp, 256 + 64 * (p // 2) + 4 * r + i]) >> (4 * (p % 2))
    assert (high & 3, (high >> 2) & 3) == (int(codes[n, x]) >> 4, int(codes[n, x + 4]) >> 4)
    assert int(sc[b, grp, 1, r]) == int(scale[n, 2 * grp + 1])
    back, sc2, d2 = unpack_q6(qweight, sc, dd.view(torch.int16))
    assert torch.equal(back, codes.to(torch.uint8)) and torch.equal(sc2, scale) and torch.equal(d2, d.half())
    with pytest.raises(ValueError, match="in % 256"):
        pack_q6(codes[:, :480], scale[:, :30], d)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q6_linear_computes_its_arithmetic_each_row_alone(dtype):
    """y = sum over half groups of (sum code * q_x - 32 sum q_x) * (d * scale) * s_x, in that
    order of roundings: within fp32 rounding of the same sum in float64."""
    blocks = _blocks(64, 768, 2)
    layer = Q6KLinear(blocks, None, torch.bfloat16)
    x = torch.randn(6, 768, generator=torch.Generator().manual_seed(3)).to(dtype)
    xg = x.float().view(6, -1, 32)
    amax = xg.abs().amax(-1)
    q = torch.round(xg * torch.where(amax > 0, 127 / amax, 0).unsqueeze(-1)).clamp(-127, 127)  # [T, K/32, 32]
    codes, scale, d = q6k_fields(blocks)
    w = (codes.double() - 32).view(64, -1, 16)  # [N, K/16, 16]
    dot = torch.einsum("tgi,ngi->tng", q.double().view(6, -1, 16), w)  # [T, N, K/16] exact integers
    ds = d.double().repeat_interleave(16, 1) * scale.double()  # [N, K/16]
    want = (dot * ds * (amax / 127).double().repeat_interleave(2, 1)[:, None]).sum(-1)
    got = layer.native_linear(x.contiguous())
    assert got.dtype == dtype and got.shape == (6, 64)
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item()
    for i in range(6):  # the same bits alone and beside any rows
        assert torch.equal(layer.native_linear(x[i : i + 1].contiguous()), got[i : i + 1])
    assert torch.equal(layer.native_linear(x[1:5].contiguous()), got[1:5])


@needs_kernels
def test_refuses_bad_arguments():
    layer = Q6KLinear(_blocks(16, 256, 4), None, torch.bfloat16)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="scales must be contiguous int8"):
        torch.ops.kvreuse.q6_linear(x, layer.qweight, layer.scales[:, :4], layer.d_bits)
    with pytest.raises(RuntimeError, match=r"d must be contiguous float16"):
        torch.ops.kvreuse.q6_linear(x, layer.qweight, layer.scales, layer.d_bits.float())
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.kvreuse.q6_linear(torch.randn(1, 128), layer.qweight, layer.scales, layer.d_bits)


@needs_kernels
def test_built_only_from_blocks_that_are_exactly_the_weight():
    blocks = _blocks(32, 512, 5)
    weight = dequantize_q6k(blocks)
    layer = Q6KLinear.from_gguf_blocks(blocks, weight, None, torch.bfloat16)
    assert layer is not None and "kernel=kvreuse-q6_k" in repr(layer)
    assert torch.equal(layer.dequantized_weight(), weight)
    assert layer.qweight.numel() + layer.scales.numel() + 2 * layer.d_bits.numel() == 32 * 512 * 6.5625 / 8
    off = weight.clone()
    off[7, 100] += 1e-3
    assert Q6KLinear.from_gguf_blocks(blocks, off, None, torch.bfloat16) is None  # not this tensor
    assert Q6KLinear.from_gguf_blocks(blocks[:16], weight[:16, :256], None, torch.bfloat16) is None  # wrong shape
    many = torch.randn(NATIVE_MAX_ROWS, 512, generator=torch.Generator().manual_seed(6)).bfloat16()
    dense = many.float() @ weight.T  # from NATIVE_MAX_ROWS rows: a dense product over the file's values
    torch.testing.assert_close(layer(many).float(), dense, rtol=2e-2, atol=2e-2 * dense.abs().max().item())


@needs_kernels
def test_a_model_keeps_its_q6_k_output_and_answers_a_hit_as_its_miss(monkeypatch):
    kw = dict(seed=0, dtype="bfloat16", quantization="int4", q6_k_output=True, hidden_size=256)
    loaded = tiny_model("llama", **kw)
    assert isinstance(loaded.model.get_output_embeddings(), Q6KLinear)
    assert kept_from_file(loaded.model) == ["Q6_K output"]  # what serve's start-up line says
    # the same weights with the output requantized to int8: another fingerprint (other KV, other logits)
    monkeypatch.setattr(Q6KLinear, "from_gguf_blocks", classmethod(lambda cls, *a: None))
    int8 = tiny_model("llama", **kw)
    monkeypatch.undo()
    assert isinstance(int8.model.get_output_embeddings(), Int8Linear) and kept_from_file(int8.model) == []
    assert int8.fingerprint != loaded.fingerprint
    llm = LLM(loaded=loaded, kv_cache_memory_gib=0.02, block_size=16, deterministic=True)
    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 8).input_ids[:70]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    miss, hit = llm.generate([ids], params)[0], llm.generate([ids], params)[0]
    assert hit.num_cached_tokens == 64 and miss.num_cached_tokens == 0
    assert list(hit.token_ids) == list(miss.token_ids)
    assert [lp.top_logprobs for lp in hit.logprobs] == [lp.top_logprobs for lp in miss.logprobs]
    llm.engine.pool.check_integrity()
