"""kvreuse's decoder-layer loop (models/kernels/layers.cpp): ``rope_`` computes RoPE as its
comment says, ``llama_layers`` gives exactly what the per-op path of ``LlamaForward`` gives
(the same tokens and log-probabilities to the bit, the same pool bytes) for decodes, batched
decodes, prefill chunks and scattered keys, and refuses bad arguments with an error before
writing anything. Skipped where the kernels cannot be built."""

from __future__ import annotations

import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.engine import llama_forward
from kvreuse.models.kernels import native_kernels
from kvreuse.models.quant import kept_from_file
from kvreuse.models.tiny import tiny_model

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="kvreuse's native kernels are not built here")


def _rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> torch.Tensor:
    """``x [T, H, d]`` bf16: the first ``rotated`` heads as ``bf16(bf16(x * cos) + roll(x) * sin)``,
    each product and sum in fp32 (no fused multiply-add)."""
    out = x.clone()
    xf = x[:, :rotated].float()
    a = (xf * cos.float()[:, None]).bfloat16().float()
    b = torch.roll(xf, x.shape[-1] // 2, -1) * sin.float()[:, None]
    out[:, :rotated] = (a + b).bfloat16()
    return out


def test_rope_matches_its_definition_and_leaves_other_heads():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, 64, generator=g).bfloat16()  # [T, heads, d]
    cos = torch.randn(5, 64, generator=g).bfloat16()
    sin = torch.randn(5, 64, generator=g).bfloat16()
    want = _rope_reference(x, cos, sin, 4)
    got = torch.ops.kvreuse.rope_(x.clone(), cos, sin, 4)
    assert torch.equal(got, want)
    assert torch.equal(got[:, 4:], x[:, 4:])  # heads past rotated_heads (the values) untouched


def test_rope_refuses_mismatched_shapes():
    x = torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="cos and sin must be contiguous"):
        torch.ops.kvreuse.rope_(
            x, torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16), 2
        )
    with pytest.raises(RuntimeError, match="rotated_heads within the heads"):
        torch.ops.kvreuse.rope_(
            x, torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16), 4
        )


@pytest.fixture(scope="module", params=["min-max", "q4_0"])
def tiny_int4(request):
    """Random float weights (min-max codes, a min per group), or weights as a GGUF Q4_0 file
    loads them (the file's own codes, no min plane)."""
    q4_0 = request.param == "q4_0"
    loaded = tiny_model("llama", seed=0, dtype="bfloat16", quantization="int4", q4_0_weights=q4_0)
    layers = [m for m in loaded.model.modules() if type(m).__name__ == "Int4Linear"]
    assert layers and all(m.symmetric == q4_0 for m in layers)
    assert kept_from_file(loaded.model) == (["Q4_0 codes"] if q4_0 else [])
    return loaded


def _answers(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[tuple]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=5)
    return [
        (list(o.token_ids), [(lp.top_token_ids, lp.top_logprobs) for lp in o.logprobs])
        for o in llm.generate(prompts, params)
    ]


def _workload(llm: LLM, tokenizer) -> list:
    """Misses in one batch (prefill items side by side, then four decodes a step), then hits of
    the same prompts in another order (suffix items over cached runs), then a prompt whose cached
    blocks are not consecutive slots (keys through a slot list)."""
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 60).input_ids
    prompts = [ids[i * 5 : i * 5 + 90 + 13 * i] for i in range(4)]
    out = [_answers(llm, prompts, 12), _answers(llm, prompts[::-1], 12)]
    llm.generate([ids[400:440]], SamplingParams(max_tokens=1))  # takes the next free blocks
    out.append(_answers(llm, [prompts[0][:64] + ids[440:470]], 10))  # cached 64, then new blocks elsewhere
    llm.engine.pool.check_integrity()
    return out


def test_llama_layers_gives_the_per_op_paths_bits(tiny_int4, monkeypatch):
    calls = {"native": 0, "per_op": 0}
    real = llama_forward._native_items

    def counting(ctx):
        items = real(ctx)
        calls["native" if items is not None else "per_op"] += 1
        return items

    # the prefill cap pinned: the workload's step count must not follow the CPU default's changes
    kwargs = dict(
        loaded=tiny_int4,
        kv_cache_memory_gib=0.05,
        block_size=16,
        deterministic=True,
        max_prefill_tokens_while_decoding=64,
    )
    monkeypatch.setattr(llama_forward, "_native_items", counting)
    native = LLM(**kwargs, max_num_batched_tokens=64)  # prefill chunks of 64 beside decodes
    got = _workload(native, tiny_int4.tokenizer)
    assert calls == {"native": 40, "per_op": 0}  # every step of the workload ran the C++ loop
    monkeypatch.setattr(llama_forward, "_native_items", lambda ctx: None)
    per_op = LLM(**kwargs, max_num_batched_tokens=64)
    assert _workload(per_op, tiny_int4.tokenizer) == got
    assert torch.equal(native.engine.runner.kv.tensor, per_op.engine.runner.kv.tensor)
    # the scattered prompt really read its keys through a slot list
    assert any(len(runs) > 1 for runs in _runs_of_last_prompt(native))


def _runs_of_last_prompt(llm: LLM) -> list[tuple]:
    """The kv_runs of a one-token item over the last prompt's keys, as the runner builds them."""
    runner = llm.engine.runner
    seen: list[tuple] = []
    real = runner._llama

    def spy(input_ids, position_ids, logits_index, ctx, num_layers=None):
        seen.extend(item.kv_runs for item in ctx.prefills)
        return real(input_ids, position_ids, logits_index, ctx, num_layers)

    runner._llama = spy
    try:
        ids = llm.tokenizer("The quick brown fox jumps over the lazy dog. " * 60).input_ids
        prompt = ids[0:64] + ids[440:470]
        llm.generate([prompt], SamplingParams(max_tokens=2))
    finally:
        runner._llama = real
    return seen


def _layer_args(rows: int = 2, layers: int = 1):
    """Arguments llama_layers accepts: a tiny model's int4 layers over a fresh bf16 pool."""
    llm = LLM(loaded=tiny_model("llama", seed=0, dtype="bfloat16", quantization="int4"), kv_cache_memory_gib=0.01)
    fwd = llm.engine.runner._llama
    pool = torch.zeros_like(llm.engine.runner.kv.tensor)
    d = fwd.head_dim
    x = torch.randn(rows, fwd.hidden).bfloat16()
    cos, sin = torch.ones(rows, d, dtype=torch.bfloat16), torch.zeros(rows, d, dtype=torch.bfloat16)
    weights = llama_forward._layer_weights(fwd.layers[:layers])
    slots = torch.arange(rows)
    items = [0, rows, 0, rows]
    return fwd, [x, weights, fwd.eps, cos, sin, pool, slots, items, [None], fwd.num_heads, fwd.num_kv_heads, 0.125]


def test_llama_layers_refuses_bad_arguments_before_writing():
    fwd, args = _layer_args()
    pool = args[5]
    bad = {
        "weights must be 14 tensors a layer": (1, args[1][:13]),
        "write slot": (6, torch.tensor([0, pool.shape[3]])),
        "item 0 rows": (7, [0, 3, 0, 3]),
        "run outside the pool": (7, [0, 2, pool.shape[3] - 1, 2]),
        "has 1 slots for 2 keys": (8, [torch.tensor([0])]),
        "heads must be a multiple": (9, fwd.num_heads + 1),
    }
    for message, (index, value) in bad.items():
        call = list(args)
        call[index] = value
        if message == "has 1 slots for 2 keys":
            call[7] = [0, 2, -1, 2]
        with pytest.raises(RuntimeError, match=message):
            torch.ops.kvreuse.llama_layers(*call)
        assert not pool.any()  # refused before any write
    out = torch.ops.kvreuse.llama_layers(*args)  # the same arguments, unbroken, run
    assert out.shape == args[0].shape and bool(torch.isfinite(out.float()).all())
    assert pool.any()


def test_head_dims_the_attention_kernels_cannot_read_keep_the_per_op_path():
    """d = 8 (not a multiple of 16): the per-op path attends in torch; llama_layers would refuse
    the step (after writing layer 0's keys), failing every request."""
    loaded = tiny_model("llama", seed=0, dtype="bfloat16", quantization="int4", head_dim=8)
    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 4).input_ids[:30]
    llm = LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=16, deterministic=True)
    assert llm.engine.runner._llama.native_fused
    (out,) = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_llama_layers_refuses_bad_slot_lists_and_runs_before_writing():
    """A slot list's dtype, shape and every slot are checked with the other arguments, not by the
    attention kernel after layer 0's keys are written; run bounds do not overflow."""
    _, args = _layer_args()
    pool = args[5]
    bad = {
        "slot 1000000000 outside the pool": [torch.tensor([0, 10**9])],
        "slot -1 outside the pool": [torch.tensor([-1, 0])],
        "slots must be a contiguous int64": [torch.tensor([0, 1], dtype=torch.int32)],
    }
    for message, slots in bad.items():
        call = list(args)
        call[7], call[8] = [0, 2, -1, 2], slots
        with pytest.raises(RuntimeError, match=message):
            torch.ops.kvreuse.llama_layers(*call)
        assert not pool.any()
    for items in ([0, 2, 2**62, 2**62], [2**62, 2**62, 0, 2]):  # sums past int64
        call = list(args)
        call[7] = items
        with pytest.raises(RuntimeError, match="kvreuse llama_layers: item 0"):
            torch.ops.kvreuse.llama_layers(*call)
        assert not pool.any()
    call = list(args)
    call[5] = torch.zeros(*pool.shape[:4], 8, dtype=torch.bfloat16)  # d 8: attention cannot read it
    with pytest.raises(RuntimeError, match="head dim 8 must be a multiple of 16"):
        torch.ops.kvreuse.llama_layers(*call)


@pytest.mark.parametrize("deterministic", [True, False])
def test_head_dims_over_256_keep_rope(deterministic):
    """rope_ takes any even head dim: the per-op path runs it for every int4 model (before
    rope_ it was torch's arithmetic, for any d), so d 512 must answer."""
    loaded = tiny_model(
        "llama",
        seed=0,
        dtype="bfloat16",
        quantization="int4",
        head_dim=512,
        hidden_size=128,
        num_heads=2,
        num_kv_heads=1,
    )
    ids = loaded.tokenizer("The quick brown fox jumps over the lazy dog. " * 4).input_ids[:30]
    llm = LLM(loaded=loaded, kv_cache_memory_gib=0.01, block_size=16, deterministic=deterministic)
    assert llm.engine.runner._llama.native_fused
    (out,) = llm.generate([ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 512, generator=g).bfloat16()
    cos, sin = torch.randn(3, 512, generator=g).bfloat16(), torch.randn(3, 512, generator=g).bfloat16()
    assert torch.equal(torch.ops.kvreuse.rope_(x.clone(), cos, sin, 1), _rope_reference(x, cos, sin, 1))
