"""KV pool formats (engine/kv_quant.py): int8 rows (values + one bf16 scale per token and KV head)
quantize within half a step, dequantize to exactly ``q * scale``, are written once and read back
as written; fp8 rows (e4m3 / e5m2 values + the same scale) saturate and are read back as
their exact float8 values; float formats read and write exactly as the bare pool tensor did; a format's bytes
per token and its identity (what the model fingerprint folds in) are fixed numbers."""

import pytest
import torch

from kvreuse.engine import config, kv_quant
from kvreuse.engine.kv_quant import SCALE_BYTES, KVFormat, KVSide, KVStore, dequantize, layer_sides, qmax, quantize
from kvreuse.engine.kv_transfer import HostKVTransfer
from kvreuse.tiers.block_codec import BlockRecord, decode_block, encode_block
from kvreuse.tiers.namespace import TierNamespace

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def test_int8_rows_hold_values_then_a_bf16_scale():
    x = torch.tensor([[1.0, -2.0, 0.5, 127.0]])  # [1, 4]: max |x| = 127 -> scale 1
    rows = quantize(x)
    assert rows.dtype == torch.uint8 and rows.shape == (1, 4 + SCALE_BYTES)
    assert rows[0, :4].view(torch.int8).tolist() == [1, -2, 0, 127]  # round half to even: 0.5 -> 0
    assert rows[0, 4:].view(torch.bfloat16).item() == 1.0
    assert torch.equal(dequantize(rows, torch.float32), torch.tensor([[1.0, -2.0, 0.0, 127.0]]))


def test_quantization_error_is_at_most_half_a_step_per_row():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 64, generator=g) * torch.rand(3, 50, 1, generator=g) * 10  # rows of many scales
    rows = quantize(x)
    scale = rows[..., 64:].view(torch.bfloat16).float()  # [3, 50, 1]
    err = (dequantize(rows, torch.float32) - x).abs()
    # half a step, plus the clamp at 127 where the bf16 scale rounded below max|x| / 127
    assert bool((err <= scale * 0.5 + x.abs().amax(-1, keepdim=True) / 127 * 2**-8 + 1e-6).all())
    assert rows[..., :64].view(torch.int8).abs().max().item() == 127


def test_an_all_zero_row_stays_zero_and_finite():
    rows = quantize(torch.zeros(2, 8))
    out = dequantize(rows, torch.bfloat16)
    assert torch.equal(out, torch.zeros(2, 8, dtype=torch.bfloat16))
    assert bool(torch.isfinite(rows[:, 8:].view(torch.bfloat16).float()).all())


def test_formats_resolve_and_count_bytes():
    auto = KVFormat.resolve("auto", torch.bfloat16)
    assert auto.name == "bfloat16" and not auto.quantized and auto.identity is None
    assert KVFormat.resolve("bfloat16", torch.bfloat16).identity is None  # the model's own dtype: unchanged ids
    assert KVFormat.resolve("float32", torch.bfloat16).identity == "kv_cache_dtype=float32"
    int8 = KVFormat.resolve("int8", torch.bfloat16)
    assert int8.quantized and int8.storage_dtype == torch.uint8 and int8.identity == "kv_cache_dtype=int8"
    # the default model: 30 layers, 3 KV heads, head_dim 64
    assert auto.bytes_per_token(30, 3, 64) == 23_040
    assert int8.bytes_per_token(30, 3, 64) == 2 * 30 * 3 * 66 == 11_880
    with pytest.raises(ValueError, match="--kv-cache-dtype"):
        KVFormat.resolve("int4", torch.bfloat16)


def test_a_float_side_reads_in_place_as_the_bare_tensor():
    pool = torch.randn(2, 2, 3, 10, 4)  # [layers, 2, kv_heads, slots, d]
    k, _ = layer_sides(pool, 1)
    assert k.run(2, 5).data_ptr() == pool[1, 0, :, 2:7].data_ptr()  # a view, no copy
    slots = torch.tensor([7, 1])
    assert torch.equal(k.select(slots), pool[1, 0].index_select(1, slots))
    new = torch.randn(3, 2, 4)
    assert k.write(slots, new) is new  # the model's dtype: what was given is what is read
    assert torch.equal(pool[1, 0, :, 7], new[:, 0]) and torch.equal(pool[1, 0, :, 1], new[:, 1])


def test_an_int8_side_writes_once_and_reads_what_it_wrote():
    store = KVStore.allocate(KVFormat.resolve("int8", torch.bfloat16), 2, 2, 12, 8, torch.device("cpu"))
    k, v = store.sides[0]
    assert isinstance(k, KVSide) and store.tensor.shape == (2, 2, 2, 12, 8 + SCALE_BYTES)
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)  # [kv_heads, T, d]
    slots = torch.tensor([4, 5, 9])
    back = k.write(slots, x)
    assert back.dtype == torch.bfloat16
    assert torch.equal(k.select(slots), back)  # the new tokens attend to exactly what later reads see
    assert torch.equal(k.run(4, 2), back[:, :2])
    assert torch.equal(store.tensor[0, 0, :, [4, 5, 9]], quantize(x))
    assert int(store.tensor[0, 1].count_nonzero()) == 0  # V untouched
    assert torch.equal(store.gather(0, slots)[0], back)


def test_rows_move_out_and_back_bit_for_bit():
    fmt = KVFormat.resolve("int8", torch.float32)
    a = KVStore.allocate(fmt, 2, 2, 8, 4, torch.device("cpu"))
    a.tensor.copy_(torch.randint(0, 256, a.tensor.shape, dtype=torch.uint8))
    rows = a.read_rows([3, 6])  # [layers, 2, n, kv_heads, row]
    assert rows.shape == (2, 2, 2, 2, 4 + SCALE_BYTES)
    b = KVStore.allocate(fmt, 2, 2, 8, 4, torch.device("cpu"))
    b.write_rows([0, 1], rows)
    assert torch.equal(b.tensor[:, :, :, :2], a.tensor[:, :, :, [3, 6]])
    with pytest.raises(ValueError, match="int8 rows"):
        b.write_rows([0, 1], rows.float())


def test_shifted_copy_requantizes_keys_into_new_slots_and_leaves_the_source():
    store = KVStore.allocate(KVFormat.resolve("int8", torch.float32), 1, 1, 8, 4, torch.device("cpu"))
    k, v = store.sides[0]
    src = torch.tensor([0, 1])
    k.write(src, torch.randn(1, 2, 4))
    v.write(src, torch.randn(1, 2, 4))
    before = store.tensor.clone()
    store.copy_shifted(src, torch.tensor([5, 6]), lambda keys: -keys)  # keys [layers, kv_heads, n, d]
    assert torch.equal(store.tensor[:, :, :, :2], before[:, :, :, :2])  # a shared block is never rewritten
    assert torch.equal(k.select(torch.tensor([5, 6])), -k.select(src))  # -q * s: exact
    assert torch.equal(store.tensor[0, 1, :, 5:7], before[0, 1, :, 0:2])  # values copied as they are


def test_fp8_rows_hold_float8_bits_then_a_bf16_scale_e4m3_against_e5m2():
    x = torch.tensor([[0.0, 448.0, -448.0, 1e-3, 3.0, -0.7, 100.0, 447.0]])  # [1, 8]: max |x| = 448
    assert qmax(E4M3) == 448.0 and qmax(E5M2) == 57344.0 and qmax(torch.int8) == 127.0
    e4 = quantize(x, E4M3)
    assert e4.dtype == torch.uint8 and e4.shape == (1, 8 + SCALE_BYTES)
    assert e4[0, 8:].view(torch.bfloat16).item() == 1.0  # 448 / 448
    # 3 mantissa bits: 1e-3 -> the smallest subnormal 2^-9, -0.7 -> -0.6875, 100 -> 96, 447 -> 448
    assert e4[0, :8].view(E4M3).float().tolist() == [0.0, 448.0, -448.0, 2**-9, 3.0, -0.6875, 96.0, 448.0]
    assert dequantize(e4, torch.float32, E4M3).tolist() == [[0.0, 448.0, -448.0, 2**-9, 3.0, -0.6875, 96.0, 448.0]]
    e5 = quantize(x, E5M2)
    assert e5[0, 8:].view(torch.bfloat16).item() == 2**-7  # 448 / 57344
    # 2 mantissa bits, 5 exponent bits: 1e-3 / 2^-7 = 0.128 -> 0.125, -0.7 -> -0.75
    assert e5[0, :8].view(E5M2).float().tolist() == [0.0, 57344.0, -57344.0, 0.125, 384.0, -96.0, 12288.0, 57344.0]
    assert dequantize(e5, torch.float32, E5M2).tolist() == [[0.0, 448.0, -448.0, 2**-10, 3.0, -0.75, 96.0, 448.0]]
    assert not torch.equal(e4, e5)  # the same values, other bytes


def test_fp8_saturates_where_the_bf16_scale_rounds_below_max_over_qmax():
    x = torch.tensor([[449.0, -449.0, 1.0, 0.0]])  # 449 / 448 rounds to the bf16 scale 1.0
    rows = quantize(x, E4M3)
    assert rows[0, 4:].view(torch.bfloat16).item() == 1.0
    assert rows[0, :4].view(E4M3).float().tolist() == [448.0, -448.0, 1.0, 0.0]  # clamped, not NaN
    big = torch.tensor([[3.0e38, -1.0e38, 1.0, -2.0], [1e-30, 0.0, -1e-30, 5e-31]])  # fp32's range, both ends
    for code in (E4M3, E5M2):
        back = dequantize(quantize(big, code), torch.float32, code)
        assert bool(torch.isfinite(back).all())
        assert back[0, 0].item() == pytest.approx(3.0e38, rel=2**-6) and back[0, 1].item() < 0


def test_fp8_all_zero_rows_and_tiny_rows_stay_finite():
    for code in (E4M3, E5M2):
        rows = quantize(torch.zeros(2, 8), code)
        assert torch.equal(dequantize(rows, torch.bfloat16, code), torch.zeros(2, 8, dtype=torch.bfloat16))
        tiny = dequantize(quantize(torch.full((1, 4), 1e-35), code), torch.float32, code)
        assert bool(torch.isfinite(tiny).all())  # the scale floor (1e-30): tiny rows round to 0, never NaN


def test_fp8_relative_error_per_row_is_bounded_by_the_mantissa():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 64, generator=g) * torch.rand(3, 50, 1, generator=g) * 10
    amax = x.abs().amax(-1, keepdim=True)
    for code, mantissa, smallest in ((E4M3, 3, 2.0**-9), (E5M2, 2, 2.0**-16)):
        rows = quantize(x, code)
        scale = rows[..., 64:].view(torch.bfloat16).float()
        err = (dequantize(rows, torch.float32, code) - x).abs()
        # half an ulp of the value (or of the smallest subnormal), plus the clamp where the
        # scale rounded below max|x| / qmax, in the row's units
        bound = (x.abs() * 2.0 ** -(mantissa + 1)).maximum(scale * smallest / 2) + amax * 2**-8 + 1e-6
        assert bool((err <= bound).all())


def test_fp8_formats_resolve_count_bytes_and_differ_from_int8():
    fp8 = KVFormat.resolve("fp8", torch.bfloat16)  # vLLM's name
    assert fp8 == KVFormat.resolve("fp8_e4m3", torch.bfloat16) and fp8.code == E4M3
    e5 = KVFormat.resolve("fp8_e5m2", torch.bfloat16)
    int8 = KVFormat.resolve("int8", torch.bfloat16)
    assert fp8.quantized and fp8.storage_dtype == torch.uint8 and fp8.bytes_per_token(30, 3, 64) == 11_880
    assert e5.code == E5M2 and e5.bytes_per_token(30, 3, 64) == 11_880
    identities = {int8.identity, fp8.identity, e5.identity}
    assert identities == {"kv_cache_dtype=int8", "kv_cache_dtype=fp8_e4m3", "kv_cache_dtype=fp8_e5m2"}
    assert fp8.description == "fp8_e4m3 (one bf16 scale per token and KV head)"
    assert config.KV_CACHE_DTYPES == kv_quant.KV_CACHE_DTYPES  # what --kv-cache-dtype and LLM() accept
    assert config.EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"


def test_an_fp8_side_writes_once_reads_what_it_wrote_and_never_hands_rows_to_kernels():
    store = KVStore.allocate(KVFormat.resolve("fp8", torch.bfloat16), 2, 2, 12, 8, torch.device("cpu"))
    k, v = store.sides[0]
    assert store.tensor.dtype == torch.uint8 and store.head_dim == 8
    x = torch.randn(2, 3, 8, dtype=torch.bfloat16)  # [kv_heads, T, d]
    slots = torch.tensor([4, 5, 9])
    back = k.write(slots, x)
    assert back.dtype == torch.bfloat16
    assert torch.equal(store.tensor[0, 0, :, [4, 5, 9]], quantize(x, E4M3))
    assert torch.equal(k.select(slots), back) and torch.equal(k.run(4, 2), back[:, :2])
    assert int(store.tensor[0, 1].count_nonzero()) == 0  # V untouched
    # the kernels read int8 rows only: fp8 rows reach them dequantized, the same values
    assert torch.equal(k.stored_run(4, 2), back[:, :2]) and torch.equal(k.stored_select(slots), back)
    rows, at = k.stored_at(slots)
    assert at is None and torch.equal(rows, back)
    int8 = KVStore.allocate(KVFormat.resolve("int8", torch.bfloat16), 1, 2, 12, 8, torch.device("cpu"))
    rows, at = int8.sides[0][0].stored_at(slots)
    assert at is slots and rows.data_ptr() == int8.tensor.data_ptr()  # int8: the side in place


def test_fp8_shifted_copy_requantizes_keys_and_copies_values_as_bytes():
    store = KVStore.allocate(KVFormat.resolve("fp8_e5m2", torch.float32), 1, 1, 8, 4, torch.device("cpu"))
    k, v = store.sides[0]
    src = torch.tensor([0, 1])
    k.write(src, torch.randn(1, 2, 4))
    v.write(src, torch.randn(1, 2, 4))
    before = store.tensor.clone()
    store.copy_shifted(src, torch.tensor([5, 6]), lambda keys: -keys)
    assert torch.equal(store.tensor[:, :, :, :2], before[:, :, :, :2])  # the source never rewritten
    assert torch.equal(k.select(torch.tensor([5, 6])), -k.select(src))  # sign flip: exact in fp8
    assert torch.equal(store.tensor[0, 1, :, 5:7], before[0, 1, :, 0:2])


def test_the_tier_codec_carries_fp8_blocks_unchanged():
    """An fp8 block read off the pool as the host tier moves it (``HostKVTransfer``), through the
    block codec disk and Redis store, and written into another block: the same bytes, the same
    keys and values read back."""
    fmt = KVFormat.resolve("fp8", torch.bfloat16)
    store = KVStore.allocate(fmt, 2, 2, 8, 16, torch.device("cpu"))  # 2 blocks of 4 slots
    for layer in range(2):
        for side in store.sides[layer]:
            side.write(torch.arange(4), torch.randn(2, 4, 16, dtype=torch.bfloat16) * 10.0**layer)
    mover = HostKVTransfer(store.tensor, 2, 4)
    block = mover.read_device([0])[:, :, :, 0].contiguous()  # [layers, 2, kv_heads, 4, 16 + 2] uint8
    ns = TierNamespace("ab" * 32, "sha256", 4)
    data = encode_block(BlockRecord(key=b"k" * 32, parent_key=None, token_ids=(1, 2, 3, 4), kv=block), ns)
    back = decode_block(data, ns, shape=tuple(block.shape), dtype=torch.uint8)
    assert back.kv.dtype == torch.uint8 and torch.equal(back.kv, block)
    mover.write_device([1], back.kv.unsqueeze(3))
    assert torch.equal(store.tensor[:, :, :, 4:8], store.tensor[:, :, :, 0:4])
    assert torch.equal(store.gather(1, torch.arange(4, 8)), store.gather(1, torch.arange(4)))
    with pytest.raises(ValueError, match="fp8_e4m3 rows"):
        store.write_rows([0], store.read_rows([1]).float())


@pytest.mark.parametrize("code", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_reads_every_finite_code_as_torchs_cast_does(code, dtype):
    """``dequantize`` reads e4m3 by its bits (not torch's cast): every finite code of the 256,
    subnormals and -0 included, comes out exactly as the cast gives it, times the scale."""
    codes = torch.arange(256, dtype=torch.uint8)
    finite = torch.isfinite(codes.view(code).float())
    rows = torch.cat([codes.view(16, 16), torch.tensor([1.5], dtype=torch.bfloat16).view(torch.uint8).expand(16, 2)], 1)
    got = dequantize(rows, dtype, code).reshape(256)  # [256]
    want = codes.view(code).to(dtype) * torch.tensor(1.5, dtype=dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(got[finite].view(bits), want[finite].view(bits))  # to the bit: -0 stays -0
