"""kvreuse's own CPU kernels (kvreuse.models.kernels): the layouts round-trip exactly, the ops
compute their documented arithmetic, each row is computed alone (batch invariance, bit for
bit), and the quantized layers use them for bf16 activations. Skipped where the kernels cannot
be built (no compiler, not x86-64, no AVX2)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvreuse.models import invariant, quant
from kvreuse.models.kernels import native, native_kernels
from kvreuse.models.kernels.packing import pack_q4, pack_q8, unpack_q4, unpack_q8
from kvreuse.models.quant import Int4Linear, Int8Linear
from kvreuse.models.quant.int4_linear import _symmetric_codes

KERNELS = native_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="kvreuse's native kernels are not built on this machine")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _q8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' activation quantization, in torch: ``(q [T, K/32, 32], scale [T, K/32], sum
    [T, K/32])``, q = round-half-even(x * 127 / amax), scale = amax / 127."""
    xg = x.float().view(x.shape[0], -1, 32)
    amax = xg.abs().amax(-1)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return torch.round(xg * inv.unsqueeze(-1)).clamp(-127, 127), amax / 127, xg.sum(-1)


def test_int4_layout_round_trips_exactly():
    codes = torch.randint(0, 16, (48, 96), generator=_gen(0))
    scale, minimum = torch.rand(48, 3, generator=_gen(1)), -torch.rand(48, 3, generator=_gen(2))
    packed, d, m = pack_q4(codes, scale, minimum)
    assert packed.shape == (3, 3, 256) and packed.dtype == torch.uint8 and d.shape == m.shape == (3, 3, 16)
    # byte (p, r, i) of group g: row r's code of input 8p + i (low nibble), 8p + 4 + i (high)
    assert packed[1, 2, 64 * 3 + 4 * 5 + 2].item() == codes[16 + 5, 64 + 26] | (codes[16 + 5, 64 + 30] << 4)
    back, d2, m2 = unpack_q4(packed, d.view(torch.int16), m.view(torch.int16))
    assert torch.equal(back, codes.to(torch.uint8))
    assert torch.equal(d2, scale.half()) and torch.equal(m2, minimum.half())
    with pytest.raises(ValueError, match="out % 16"):
        pack_q4(codes[:40], scale[:40], minimum[:40])


@pytest.mark.parametrize("unsigned", [True, False])
def test_int8_layout_round_trips_exactly(unsigned):
    q = torch.randint(-127, 128, (32, 64), generator=_gen(3), dtype=torch.int8)
    packed, scale = pack_q8(q, torch.rand(32, generator=_gen(4)), unsigned)
    assert packed.shape == (2, 16, 64) and scale.dtype == torch.float32
    byte = packed[1, 7, 4 * 9 + 3].item()  # chunk 7, row 9 of block 1, input 4 * 7 + 3
    assert byte == (int(q[25, 31]) + 128 if unsigned else int(q[25, 31]) & 0xFF)
    assert torch.equal(unpack_q8(packed, unsigned), q)


@needs_kernels
@pytest.mark.parametrize("n, k", [(64, 576), (960, 576), (576, 1536)])
def test_q4_linear_computes_its_arithmetic(n, k):
    """y = sum_g (sum_i code * q_x) * scale * s_x + min * sum(x): within fp32 rounding of the
    same sum in torch."""
    codes = torch.randint(0, 16, (n, k), generator=_gen(5))
    scale, minimum = torch.rand(n, k // 32, generator=_gen(6)) * 0.01, -torch.rand(n, k // 32, generator=_gen(7)) * 0.1
    packed, d, m = pack_q4(codes, scale, minimum)
    x = torch.randn(5, k, generator=_gen(8))
    q, s, xsum = _q8_activations(x)
    dot = torch.einsum("tgi,ngi->tng", q.double(), codes.double().view(n, -1, 32))  # [T, N, G] exact integers
    want = (dot * d.double().transpose(1, 2).reshape(n, -1) * s.double()[:, None]).sum(-1) + (
        m.double().transpose(1, 2).reshape(n, -1) * xsum.double()[:, None]
    ).sum(-1)
    got = torch.ops.kvreuse.q4_linear(x, packed, d, m)
    assert got.shape == (5, n) and got.dtype == torch.float32
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@needs_kernels
def test_q8_linear_computes_its_arithmetic():
    n, k = 96, 576
    w = torch.randint(-127, 128, (n, k), generator=_gen(9), dtype=torch.int8)
    row_scale = torch.rand(n, generator=_gen(10)) * 0.01
    packed, scale = pack_q8(w, row_scale, KERNELS.q8_unsigned)
    x = torch.randn(3, k, generator=_gen(11))
    q, s, _ = _q8_activations(x)
    dot = torch.einsum("tgi,ngi->tng", q.double(), w.double().view(n, -1, 32))
    want = (dot * s.double()[:, None]).sum(-1) * row_scale.double()
    got = torch.ops.kvreuse.q8_linear(x, packed, scale.view(torch.int32))
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_or_tiny_activations_keep_their_meaning(dtype):
    """A NaN or an inf in a row of x makes that row's outputs NaN, as a float product's would be
    non-finite (the int8 kernel used to return finite values, and -inf for +inf); a group whose
    largest value is below ~3.7e-37 (where 127 / amax overflows fp32) keeps its sign."""
    packed, scale = pack_q8(torch.ones(16, 64, dtype=torch.int8), torch.ones(16), KERNELS.q8_unsigned)
    p4, d4, m4 = pack_q4(torch.ones(16, 64, dtype=torch.int64), torch.ones(16, 2), torch.zeros(16, 2))
    ops = {
        "q8": lambda x: torch.ops.kvreuse.q8_linear(x, packed, scale),
        "q4": lambda x: torch.ops.kvreuse.q4_linear(x, p4, d4, m4),
    }
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.ones(2, 64, dtype=dtype)
        x[0, 5] = bad
        for name, op in ops.items():
            y = op(x).float()
            assert torch.isnan(y[0]).all(), (name, bad, y[0, :4].tolist())
            torch.testing.assert_close(y[1], torch.full((16,), 64.0), rtol=1e-5, atol=0)  # other rows unaffected
    tiny = torch.full((1, 64), 1e-37, dtype=dtype)
    want = 64 * tiny.double()[0, 0].item()
    for name, op in ops.items():
        got = op(tiny).double()
        assert ((got - want).abs() <= 1e-2 * want).all(), (name, got[0, :4].tolist(), want)


@needs_kernels
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_row_is_the_same_bits_alone_and_in_any_batch(kind):
    layer = (Int4Linear if kind == "int4" else Int8Linear)(
        torch.randn(192, 576, generator=_gen(12)), None, torch.bfloat16
    )
    assert layer.native
    x = torch.randn(37, 576, generator=_gen(13)).bfloat16()
    with torch.inference_mode():
        batch = layer.native_linear(x)
        alone = torch.cat([layer.native_linear(x[i : i + 1]) for i in range(37)])
        mid = layer.native_linear(x[5:11])
    assert batch.dtype == torch.bfloat16
    assert torch.equal(batch, alone) and torch.equal(batch[5:11], mid)
    assert torch.equal(invariant.project(layer, x), batch)  # --deterministic's projection is the kernel


@needs_kernels
def test_bf16_output_is_the_fp32_output_rounded():
    layer = Int4Linear(torch.randn(64, 96, generator=_gen(14)), None, torch.bfloat16)
    x = torch.randn(3, 96, generator=_gen(15))
    fp32 = torch.ops.kvreuse.q4_linear(x, layer.qweight, layer.scale_zero[0], layer.scale_zero[1])
    bf16 = torch.ops.kvreuse.q4_linear(x.bfloat16(), layer.qweight, layer.scale_zero[0], layer.scale_zero[1])
    want = torch.ops.kvreuse.q4_linear(x.bfloat16().float(), layer.qweight, layer.scale_zero[0], layer.scale_zero[1])
    assert torch.equal(bf16, want.bfloat16()) and fp32.dtype == torch.float32


@needs_kernels
def test_int4_layer_keeps_its_weights_and_computes_them():
    """The native layer holds 5 bits a weight, survives the model's .to(bfloat16), and its few-row
    output is its dequantized weight's within the int8 rounding of the activations."""
    w = torch.randn(128, 576, generator=_gen(16))
    layer = Int4Linear(w, None, torch.bfloat16).to(torch.bfloat16)
    torch_layer = Int4Linear(w, None, torch.bfloat16, native=False)
    assert layer.native and not torch_layer.native and "kernel=kvreuse" in repr(layer)
    assert layer.qweight.numel() + 2 * layer.scale_zero.numel() == 128 * 576 // 2 + 128 * 18 * 4  # 5 bits
    ref = torch_layer.unpacked_weight(torch.float32)
    # the same codes; scale and min now float16 (torch's layout rounds them to bf16)
    assert (layer.unpacked_weight(torch.float32) - ref).abs().max().item() <= 2**-7 * ref.abs().max().item()
    x = torch.randn(4, 576, generator=_gen(17)).bfloat16()
    want = x.float() @ layer.dequantized_weight().float().T
    got = layer(x).float()
    assert (got - want).abs().max().item() <= 0.02 * want.abs().max().item()
    many = torch.randn(quant.DENSE_MIN_ROWS, 576, generator=_gen(18)).bfloat16()
    if quant.dense_dtype(len(many), torch.bfloat16) is not None:  # a prefill chunk: dense over the unpacked copy
        dense = many.float() @ layer.unpacked_weight(torch.float32).T
        torch.testing.assert_close(layer(many).float(), dense, rtol=2e-2, atol=2e-2 * dense.abs().max().item())


def _q4_0(n: int, k: int, seed: int) -> torch.Tensor:
    """``[n, k]`` as a GGUF Q4_0 tensor loads: gguf-py's port of llama.cpp's quantizer and back."""
    import gguf
    from gguf import quants

    kind = gguf.GGMLQuantizationType.Q4_0
    w = torch.randn(n, k, generator=_gen(seed)).numpy()
    return torch.from_numpy(quants.dequantize(quants.quantize(w, kind), kind))


def test_q4_0_codes_are_read_back_exactly_and_nothing_else_passes():
    w = _q4_0(32, 96, 30)
    w[3, 32:64] = 0  # an all-zero group: scale 0
    w[4, :32] *= -1  # a group whose peak is positive: a negative scale
    q, d = _symmetric_codes(w, 32)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15
    assert torch.equal(((q.view(32, 3, 32) - 8) * d[..., None]).view(32, 96), w)
    assert d[3, 1].item() == 0 and d[4, 0].item() < 0 and torch.equal(d.half().float(), d)
    off = w.clone()
    off[7, 40] += 1e-3  # one value off its group's grid: the tensor is not Q4_0
    assert _symmetric_codes(off, 32) is None
    assert _symmetric_codes(torch.randn(32, 96, generator=_gen(31)), 32) is None  # float weights
    q41 = _q4_0(32, 96, 32) + 0.5 * torch.rand(32, 3, generator=_gen(33)).repeat_interleave(32, 1)
    assert _symmetric_codes(q41, 32) is None  # an offset grid (Q4_1-like): a min per group is needed


@needs_kernels
def test_a_q4_0_layer_keeps_no_min_plane_and_computes_the_two_plane_bits():
    """A Q4_0 tensor's layer holds 4.5 bits a weight, dequantizes to the file's exact values,
    and its output is bit for bit the two-plane layout's with its mins (-8 * scale) written out."""
    w = _q4_0(64, 576, 34)
    layer = Int4Linear(w, None, torch.bfloat16).to(torch.bfloat16)
    assert layer.symmetric and "kernel=kvreuse-q4_0" in repr(layer)
    assert layer.native_min.numel() == 0 and layer.scale_zero.shape == (1, 4, 18, 16)
    assert layer.qweight.numel() + 2 * layer.scale_zero.numel() == 64 * 576 // 2 + 64 * 18 * 2  # 4.5 bits
    assert torch.equal(layer.unpacked_weight(torch.float32), w)
    codes, d, m = unpack_q4(layer.qweight, layer.native_scale, layer.native_min)
    assert torch.equal(m, -8 * d)
    two = layer.native_planes(2)
    assert two.shape == (2, 4, 18, 16) and torch.equal(two[0], layer.native_scale)
    for rows in (1, 2, 3, 4, 5):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, 576, generator=_gen(35 + rows)).to(dtype)
            assert torch.equal(layer.native_linear(x), torch.ops.kvreuse.q4_linear(x, layer.qweight, two[0], two[1]))
    x = torch.randn(3, 576, generator=_gen(40)).bfloat16()
    norm, res = torch.rand(576, generator=_gen(41)).bfloat16(), torch.randn(3, 64, generator=_gen(42)).bfloat16()
    fused = torch.ops.kvreuse.q4_linear_fused(x, layer.qweight, two[0], two[1], norm, 1e-5, False, res)
    assert torch.equal(layer.native_fused(x, norm, 1e-5, residual=res), fused)
    with pytest.raises(RuntimeError, match="mins empty"):
        torch.ops.kvreuse.q4_linear(x, layer.qweight, two[0], two[1][:2])
    with pytest.raises(ValueError, match="min plane"):
        Int4Linear(torch.randn(64, 576, generator=_gen(43)), None, torch.bfloat16).native_planes(1)


@needs_kernels
def test_q4_0_and_min_max_layers_fuse_into_one_projection():
    """q and k from a Q4_0 file beside a float v: the fused layer writes the Q4_0 parts' mins out
    (exact) and computes each part's bits; Q4_0 parts alone keep one plane."""
    sym = [Int4Linear(_q4_0(n, 576, 44 + n), None, torch.bfloat16) for n in (576, 192)]
    asym = Int4Linear(torch.randn(192, 576, generator=_gen(45)), None, torch.bfloat16)
    x = torch.randn(2, 576, generator=_gen(46)).bfloat16()
    for parts, planes in ((sym + [asym], 2), (sym, 1)):
        owner = torch.nn.Module()
        for name, p in zip(("q", "k", "v"), parts):
            setattr(owner, name, p)
        names = ("q", "k", "v")[: len(parts)]
        before = [p(x) for p in parts]
        fused = quant.fused_projection(owner, names)
        assert fused is not None and fused.scale_zero.size(0) == planes
        assert torch.equal(fused(x), torch.cat(before, dim=-1))


@needs_kernels
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_native_projections_fuse_and_stay_views(kind):
    cls = Int4Linear if kind == "int4" else Int8Linear
    parts = [cls(torch.randn(n, 576, generator=_gen(20 + n)), None, torch.bfloat16) for n in (576, 192, 192)]
    assert all(p.native for p in parts)
    owner = torch.nn.Module()
    for name, p in zip(("q", "k", "v"), parts):
        setattr(owner, name, p)
    x = torch.randn(2, 576, generator=_gen(19)).bfloat16()
    before = [p(x) for p in parts]
    size = quant.weight_bytes(owner)
    fused = quant.fused_projection(owner, ("q", "k", "v"))
    assert fused is not None and fused.native
    assert torch.equal(fused(x), torch.cat(before, dim=-1))
    assert all(torch.equal(p(x), b) for p, b in zip(parts, before))
    assert quant.weight_bytes(owner) == size


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv(native.ENV_SWITCH, "off")
    native.native_kernels.cache_clear()
    try:
        assert native.native_kernels() is None
        assert not Int4Linear(torch.randn(64, 96, generator=_gen(21)), None, torch.bfloat16).native
    finally:
        monkeypatch.delenv(native.ENV_SWITCH)
        native.native_kernels.cache_clear()
    assert (native.native_kernels() is None) == (KERNELS is None)


def test_a_failed_build_leaves_torchs_kernels(tmp_path):
    """No compiler: build_library raises, and a fresh process (one that has loaded no build:
    a loaded library is reused for the process's life) gets None and torch-kernel layers."""
    env = {**os.environ, "CXX": str(tmp_path / "no-such-compiler"), "KVREUSE_KERNEL_CACHE": str(tmp_path / "cache")}
    script = (
        "import torch\n"
        "from kvreuse.models.kernels import native\n"
        "from kvreuse.models.quant import Int4Linear\n"
        "try:\n    native.build_library()\n"
        "except (RuntimeError, OSError) as exc:\n    print('raised', type(exc).__name__)\n"
        "print(native.native_kernels())\n"
        "print(Int4Linear(torch.randn(64, 96), None, torch.bfloat16).native)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[1:3] == ["None", "False"] and done.stdout.startswith("raised")


def test_loading_a_cpu_model_readies_the_decode_kernel():
    """Every CPU model's decode attention runs on the kernels (engine/flash.py), quantized or
    not: an unquantized model's load builds or loads them, so the first request does not pay
    the ~15 s build inside its first decode step. In a fresh process (the lookup is cached)."""
    script = (
        "from kvreuse.models.kernels import native\n"
        "from kvreuse.models.tiny import tiny_model\n"
        "tiny_model('llama', seed=0, dtype='bfloat16')\n"
        "print(native.native_kernels.cache_info().currsize)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-1] == "1"


@needs_kernels
def test_q4_dequantize_is_the_unpacked_weight_rounded_once():
    layer = Int4Linear(torch.randn(64, 96, generator=_gen(22)), None, torch.bfloat16)
    codes, scale, minimum = unpack_q4(layer.qweight, layer.scale_zero[0], layer.scale_zero[1])
    want = (codes.view(64, 3, 32).float() * scale.float()[..., None] + minimum.float()[..., None]).view(64, 96)
    got = torch.ops.kvreuse.q4_dequantize(layer.qweight, layer.native_scale, layer.native_min, torch.float32)
    assert torch.equal(got, want)
    bf16 = torch.ops.kvreuse.q4_dequantize(layer.qweight, layer.native_scale, layer.native_min, torch.bfloat16)
    assert torch.equal(bf16, want.bfloat16()) and torch.equal(layer.unpacked_weight(torch.bfloat16), bf16)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in bf16: normalise in fp32, round, scale by the weight, round."""
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()).bfloat16()


@needs_kernels
def test_fused_norm_silu_and_residual_are_the_separate_ops():
    """Each folded op equals the separate PyTorch ops' result (bf16 rounding where they round),
    to within one bf16 step of the output: the kernel's own int8 rounding of the activations is
    identical when its input row is identical."""
    layer = Int4Linear(torch.randn(192, 576, generator=_gen(23)), None, torch.bfloat16)
    x = torch.randn(3, 576, generator=_gen(24)).bfloat16()
    w = (1 + 0.1 * torch.randn(576, generator=_gen(25))).bfloat16()
    normed = layer.native_fused(x, w, 1e-5)
    separate = layer.native_linear(_rms(x, w, 1e-5))
    assert (normed.float() - separate.float()).abs().max().item() <= 2**-7 * separate.float().abs().max().item()
    residual = torch.randn(3, 192, generator=_gen(26)).bfloat16()
    added = layer.native_fused(x, residual=residual)
    want = (layer.native_linear(x.float()) + residual.float()).bfloat16()  # one rounding, after the add
    assert torch.equal(added, want)
    gu = torch.randn(3, 2 * 576, generator=_gen(27)).bfloat16()
    act = torch.nn.functional.silu(gu[:, :576]) * gu[:, 576:]  # bf16 ops, as the unfused step
    gated = layer.native_fused(gu, silu_mul=True)
    ref = layer.native_linear(act)
    assert (gated.float() - ref.float()).abs().max().item() <= 2**-6 * ref.float().abs().max().item()
    alone = torch.cat([layer.native_fused(gu[i : i + 1], silu_mul=True) for i in range(3)])
    assert torch.equal(alone, gated)  # fused ops stay batch-invariant
    with pytest.raises(RuntimeError, match="residual"):
        layer.native_fused(x, residual=residual[:, :16].contiguous())


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keys", [1, 300, 700])
def test_decode_attention_is_softmax_attention_over_a_pool_view(dtype, keys):
    """A decode's stacked query heads over keys read in place from a pool-shaped tensor
    ([kv, slots, d] sliced to a run): out and log-sum-exp are fp32 attention's (to the output
    dtype's rounding); the keys are split across items of 256 and merged."""
    pool_k = torch.randn(3, 1000, 64, generator=_gen(28)).to(dtype)  # [kv, slots, d]
    pool_v = torch.randn(3, 1000, 64, generator=_gen(29)).to(dtype)
    k, v = pool_k[:, 100 : 100 + keys][None], pool_v[:, 100 : 100 + keys][None]  # views [1, kv, L, d]
    q = torch.randn(1, 3, 3, 64, generator=_gen(30)).to(dtype)  # [1, kv, groups, d]
    out, lse = torch.ops.kvreuse.decode_attention(q, k, v, 0.125)
    scores = torch.einsum("bhrd,bhld->bhrl", q.double(), k.double()) * 0.125
    want_lse = torch.logsumexp(scores, -1)
    want = torch.einsum("bhrl,bhld->bhrd", torch.softmax(scores, -1), v.double())
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == q.shape and lse.shape == (1, 3, 3)
    assert (lse.double() - want_lse).abs().max().item() < 1e-5
    tol = 1e-5 if dtype == torch.float32 else 2**-8
    assert (out.double() - want).abs().max().item() <= tol * want.abs().max().item() + 1e-6


@needs_kernels
def test_engine_flash_takes_the_decode_kernel_for_a_decode_only():
    from kvreuse.engine import flash as engine_flash

    q = torch.randn(1, 3, 3, 64).bfloat16()
    k = torch.randn(1, 3, 50, 64).bfloat16()
    assert engine_flash._native_fits(q, k, False, None)
    assert not engine_flash._native_fits(q, k, True, None)  # causal: PyTorch's kernel
    assert not engine_flash._native_fits(torch.randn(1, 3, 17, 64).bfloat16(), k, False, None)  # too many rows
    assert not engine_flash._native_fits(torch.randn(1, 9, 3, 64).bfloat16(), k, False, None)  # heads not stacked


@needs_kernels
def test_decode_attention_reads_int8_pool_rows_as_their_dequantization():
    """Over an int8 KV pool's stored rows (d int8 values + a bf16 scale) the kernel computes what
    it computes over the rows dequantized by the pool (engine/kv_quant.py), to the bit."""
    from kvreuse.engine.kv_quant import dequantize, quantize

    pool_k = quantize(torch.randn(2, 600, 64, generator=_gen(31)))  # [kv, slots, d + 2] uint8
    pool_v = quantize(torch.randn(2, 600, 64, generator=_gen(32)))
    k, v = pool_k[:, 7:507][None], pool_v[:, 7:507][None]
    q = torch.randn(1, 2, 4, 64, generator=_gen(33)).bfloat16()
    raw = torch.ops.kvreuse.decode_attention(q, k, v, 0.125)
    deq = torch.ops.kvreuse.decode_attention(q, dequantize(k, torch.bfloat16), dequantize(v, torch.bfloat16), 0.125)
    assert torch.equal(raw[0], deq[0]) and torch.equal(raw[1], deq[1])
    with pytest.raises(RuntimeError, match="int8 rows"):
        torch.ops.kvreuse.decode_attention(q.float(), k, v, 0.125)
