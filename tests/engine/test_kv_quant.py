"""KV pool formats (engine/kv_quant.py): int8 rows (values + one bf16 scale per token and KV head)
quantize within half a step, dequantize to exactly ``q * scale``, are written once and read back
as written; float formats read and write exactly as the bare pool tensor did; a format's bytes
per token and its identity (what the model fingerprint folds in) are fixed numbers."""

import pytest
import torch

from kvreuse.engine.kv_quant import SCALE_BYTES, KVFormat, KVSide, KVStore, dequantize, layer_sides, quantize


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
        KVFormat.resolve("fp8", torch.bfloat16)


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
