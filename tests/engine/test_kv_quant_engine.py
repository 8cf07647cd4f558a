"""``kv_cache_dtype="int8"`` and ``"fp8"`` (``--kv-cache-dtype``) through the real engine on tiny
random models:
the same memory holds more blocks; the format is part of the model identity (block keys, tier
namespaces), so formats share nothing in a pool, on disk or on one Redis; with the
batch-invariant forward a hit, a host-tier onboard and a disk reload read the very bytes a miss
wrote and give identical logits; documents (keys moved to new positions) and seam repair run
on int8 / fp8 K/V and never rewrite a shared block."""

import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.engine.document_cache import DocumentPrompt
from kvreuse.engine.kv_quant import SCALE_BYTES
from kvreuse.events.buffer import EventBuffer
from kvreuse.events.records import CacheCreated, record_from_json, record_to_json
from kvreuse.models.tiny import tiny_model
from tests.engine_helpers import LogitsSpy, reference_logits
from tests.tiers.conftest import redis_server  # noqa: F401  (a real redis-server per test)

ONE = SamplingParams(max_tokens=1, temperature=0)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [(i * 37) % 4000 + 10 for i in range(61)]  # 15 full blocks of 4 + 1 token
BYTE_FORMATS = ["int8", "fp8"]  # the formats of 1-byte values and a bf16 scale per row


@pytest.fixture(scope="module")
def tiny_bf16():
    return tiny_model("llama", seed=0, dtype="bfloat16")


@pytest.mark.parametrize(("fmt", "name"), [("int8", "int8"), ("fp8", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2")])
def test_byte_pool_holds_more_blocks_in_the_same_memory(tiny_llama, fmt, name):
    """2 layers, 2 KV heads, head_dim 16: fp32 512 bytes a token, 8-bit rows 2 * 2 * 2 * 18 = 144."""
    auto = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4)
    int8 = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4, kv_cache_dtype=fmt)
    assert auto.engine.kv_bytes_per_token == 512 and int8.engine.kv_bytes_per_token == 144
    assert auto.engine.pool.num_blocks == 2**30 // 1000 // (512 * 4)
    assert int8.engine.pool.num_blocks == 2**30 // 1000 // (144 * 4)
    pool = int8.engine.runner.kv_cache
    assert pool.dtype == torch.uint8 and pool.shape[-1] == 16 + SCALE_BYTES
    assert int8.engine.runner.kv_format.name == name and auto.engine.runner.kv_format.name == "float32"


def test_the_format_is_part_of_the_model_identity(tiny_llama):
    auto = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4)
    same = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4, kv_cache_dtype="float32")
    int8 = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4, kv_cache_dtype="int8")
    half = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4, kv_cache_dtype="bfloat16")
    fp8 = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4, kv_cache_dtype="fp8")
    e4m3 = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4, kv_cache_dtype="fp8_e4m3")
    e5m2 = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.001, block_size=4, kv_cache_dtype="fp8_e5m2")
    assert auto.engine.model_id == same.engine.model_id == tiny_llama.model_id  # the model's own dtype: unchanged
    assert fp8.engine.model_id == e4m3.engine.model_id  # vLLM's fp8 is e4m3: the same bytes, the same blocks
    ids = [m.engine.model_id for m in (auto, int8, half, fp8, e5m2)]
    assert len(set(ids)) == 5
    keys = [set(hash_token_blocks(PROMPT, 4, model_id=m)) for m in ids]
    assert all(not (keys[i] & keys[j]) for i in range(5) for j in range(i + 1, 5))
    assert int8.engine.loaded.fingerprint != tiny_llama.fingerprint != fp8.engine.loaded.fingerprint
    assert int8.engine.loaded.fingerprint != fp8.engine.loaded.fingerprint


def _int8(loaded, fmt: str = "int8", **kw) -> LLM:
    return LLM(loaded=loaded, kv_cache_memory_gib=kw.pop("gib", 0.001), block_size=4, kv_cache_dtype=fmt, **kw)


@pytest.mark.parametrize("fmt", [*BYTE_FORMATS, "fp8_e5m2"])
def test_byte_hit_gives_the_logits_of_a_miss_exactly(tiny_bf16, fmt):
    """Batch-invariant kernels: a hit reads the bytes the miss wrote, the miss attended to the
    same dequantized values, so every logit is equal (miss, hit, second hit, in a batch). fp8
    rows reach the kernels dequantized on both paths (``KVSide.stored_*``)."""
    llm = _int8(tiny_bf16, fmt, deterministic=True)
    spy = LogitsSpy(llm)
    miss = llm.generate(PROMPT, GREEDY)[0]
    n_miss = len(spy.rows)
    hit = llm.generate(PROMPT, GREEDY)[0]
    assert hit.num_cached_tokens == 60 and hit.token_ids == miss.token_ids
    for a, b in zip(spy.rows[:n_miss], spy.rows[n_miss:], strict=True):
        assert torch.equal(a, b)
    llm.reset_prefix_cache()
    spy.rows.clear()
    other = [t + 3 for t in PROMPT]
    batch = llm.generate([other, PROMPT], GREEDY)
    assert batch[1].token_ids == miss.token_ids and batch[1].num_cached_tokens == 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_byte_without_the_invariant_kernels_keeps_greedy_answers_and_stays_close(arch, fmt, request):
    tiny_llama = request.getfixturevalue(arch)  # Gemma 3: sliding-window layers read int8 by their masked path
    llm = _int8(tiny_llama, fmt)
    spy = LogitsSpy(llm)
    miss = llm.generate(PROMPT, GREEDY)[0]
    hit = llm.generate(PROMPT, GREEDY)[0]
    assert hit.num_cached_tokens == 60 and hit.token_ids == miss.token_ids
    assert (spy.rows[0] - spy.rows[len(spy.rows) // 2]).abs().max().item() <= 1e-4  # the same 8-bit K/V, fp32 math
    ref = reference_logits(tiny_llama.model, PROMPT)[-1]  # fp32 K/V throughout
    err = (spy.rows[0] - ref).abs().max().item()
    # quantized, and close: int8's error is an absolute max|x| / 254 per row, fp8's a relative
    # 2^-4 per value (3 mantissa bits); measured on these random models: int8 <= 1% of the
    # largest logit, fp8 3% (Llama) and 10% (Gemma 3)
    assert 0 < err <= {"int8": 0.05, "fp8": 0.15}[fmt] * ref.abs().max().item()
    llm.engine.check_integrity()


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
def test_byte_blocks_offloaded_to_host_and_back_give_identical_logits(tiny_bf16, fmt):
    llm = _int8(tiny_bf16, fmt, gib=0.0001, host_cache_memory_gib=0.001, deterministic=True)
    engine = llm.engine
    n = 4 * (engine.pool.num_blocks - 2) + 1
    a = [(i * 37) % 4000 + 10 for i in range(n)]
    b = [(i * 53) % 4000 + 7 for i in range(n)]
    spy = LogitsSpy(llm)
    llm.generate(a, ONE)
    first = spy.rows[-1]
    llm.generate(b, ONE)  # evicts a's blocks: int8 rows go down to the host
    assert engine.host.stats.offloaded_blocks > 0
    again = llm.generate(a, ONE)[0]
    engine.check_integrity()
    assert again.num_cached_tokens == n - 1 and engine.host.stats.onboarded_blocks > 0
    assert torch.equal(spy.rows[-1], first)


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
def test_byte_blocks_reloaded_from_disk_give_identical_logits_and_formats_share_nothing(tiny_bf16, tmp_path, fmt):
    def executor(**kw):
        return LLM(
            loaded=tiny_bf16,
            kv_cache_memory_gib=0.001,
            block_size=4,
            host_cache_memory_gib=0.001,
            disk_cache_dir=str(tmp_path),
            deterministic=True,
            **kw,
        )

    first = executor(kv_cache_dtype=fmt)
    spy = LogitsSpy(first)
    first.generate(PROMPT, ONE)
    assert first.engine.host.below.flush(30)
    assert first.engine.host.below.block_shape[-1] == 16 + SCALE_BYTES  # the disk holds 8-bit rows
    for other in ("auto", "int8" if fmt != "int8" else "fp8"):  # same model, same disk, another KV format
        elsewhere = executor(kv_cache_dtype=other)
        assert elsewhere.generate(PROMPT, ONE)[0].num_cached_tokens == 0
        assert elsewhere.engine.host.below.flush(30)
    restarted = executor(kv_cache_dtype=fmt)
    restarted_spy = LogitsSpy(restarted)
    out = restarted.generate(PROMPT, ONE)[0]
    restarted.engine.check_integrity()
    assert out.num_cached_tokens == 60 and restarted.engine.host.stats.loaded_blocks == 15
    assert torch.equal(restarted_spy.rows[-1], spy.rows[-1])


def test_int8_and_fp32_executors_on_one_redis_share_nothing(tiny_llama, redis_server):  # noqa: F811
    def executor(**kw):
        return LLM(
            loaded=tiny_llama,
            kv_cache_memory_gib=0.001,
            block_size=4,
            host_cache_memory_gib=0.001,
            remote_cache=redis_server.url,
            **kw,
        )

    a, b, c = executor(kv_cache_dtype="int8"), executor(), executor(kv_cache_dtype="int8")
    a.generate(PROMPT, ONE)
    assert a.engine.host.below.flush(30)
    assert b.generate(PROMPT, ONE)[0].num_cached_tokens == 0  # fp32 finds none of the int8 blocks
    assert b.engine.host.below.stats.remote_hits == 0
    on_c = c.generate(PROMPT, ONE)[0]  # int8 again: every block from Redis
    assert on_c.num_cached_tokens == 60 and c.engine.host.below.stats.remote_hits == 15
    for llm in (a, b, c):
        llm.engine.check_integrity()


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_documents_move_byte_keys_into_new_blocks_only(arch, fmt, request):
    """Llama reads documents in place (queries rotated into each frame); Gemma 3's sliding
    layers need one frame, so its documents are copied with their keys re-rotated
    (``copy_shifted``: dequantized, rotated, quantized into new blocks)."""
    llm = _int8(request.getfixturevalue(arch), fmt, gib=0.01)
    tok = llm.tokenizer
    docs = [tok.encode(f"Document {i}: the harbour office keeps ledger {i} in a green box.") for i in range(3)]
    question = tok.encode(" Which box holds ledger 1?")
    first = llm.generate(DocumentPrompt.of([(docs[0], True), (docs[1], True), (question, False)]), GREEDY)[0]
    cached = sorted(b.block_id for b in llm.engine.pool.cached_hashes())
    bs = llm.engine.block_size
    slots = torch.tensor([i * bs + o for i in cached for o in range(bs)])
    before = llm.engine.runner.kv_cache[:, :, :, slots].clone()
    again = llm.generate(DocumentPrompt.of([(docs[1], True), (docs[0], True), (question, False)]), GREEDY)[0]
    assert again.num_cached_tokens > 0 and len(again.token_ids) == len(first.token_ids) == 6
    assert torch.equal(llm.engine.runner.kv_cache[:, :, :, slots], before)  # shared int8 rows never rewritten
    # not blended: on Llama the documents are read in place, int8 rows in several RoPE frames
    unblended = {"first_tokens": 0, "ratio": 0, "last_tokens": 0}
    prompt = DocumentPrompt.of([(docs[0], True), (docs[1], True), (question, False)])
    in_place = llm.generate(prompt, GREEDY, blend=unblended)[0]
    assert in_place.num_cached_tokens > 0 and in_place.num_recomputed_tokens == 0 and len(in_place.token_ids) == 6
    assert torch.equal(llm.engine.runner.kv_cache[:, :, :, slots], before)
    llm.engine.check_integrity()


SCHEMA = """<schema name="s">Notes:
<module name="a">The lighthouse keeper on Varn island logs ships in a green ledger.</module>
<module name="b">Every ledger on the island is kept in the harbour office at dusk.</module>
</schema>"""


def _rows_by_key(llm: LLM) -> dict[bytes, torch.Tensor]:
    bs, pool = llm.engine.block_size, llm.engine.runner.kv_cache
    return {
        b.block_hash: pool[:, :, :, b.block_id * bs : (b.block_id + 1) * bs].clone()
        for b in llm.engine.pool.cached_hashes()
    }


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
def test_seam_repair_runs_on_byte_modules_and_keeps_them(tiny_llama, tmp_path, fmt):
    prompt = '<prompt schema="s"><a/><b/>Where is the ledger kept?</prompt>'
    llm = _int8(tiny_llama, fmt, gib=0.01, schema_dir=str(tmp_path))
    llm.register_schema(SCHEMA)
    modules = _rows_by_key(llm)
    out = llm.generate(prompt, GREEDY, blend={"ratio": 0.5})[0]
    assert out.num_recomputed_tokens > 0
    after = _rows_by_key(llm)
    assert all(torch.equal(after[key], rows) for key, rows in modules.items())  # shared module rows untouched
    llm.engine.check_integrity()
    # the schema store keeps the 8-bit rows as they are: a restart loads them bit for bit
    restarted = _int8(tiny_llama, fmt, gib=0.01, schema_dir=str(tmp_path))
    assert [s.name for s in restarted.engine.restored_schemas] == ["s"]
    restarted.generate(prompt, ONE)
    loaded = _rows_by_key(restarted)
    assert modules.keys() <= loaded.keys()
    assert all(torch.equal(loaded[key], rows) for key, rows in modules.items())
    restarted.engine.check_integrity()


@pytest.mark.parametrize(("fmt", "name"), [("int8", "int8"), ("fp8", "fp8_e4m3")])
def test_the_created_event_tells_the_format(tiny_llama, fmt, name):
    buffer = EventBuffer(1000)
    LLM(loaded=tiny_llama, events=buffer, kv_cache_memory_gib=0.001, block_size=4, kv_cache_dtype=fmt)
    created = buffer.drain_since_last()[0].data
    assert isinstance(created, CacheCreated) and created.kv_cache_dtype == name
    as_json = record_to_json(created)
    assert as_json["kv_cache_dtype"] == name and record_from_json(as_json) == created


@pytest.mark.parametrize("fmt", BYTE_FORMATS)
def test_byte_batched_decode_answers_as_each_alone(tiny_llama, fmt):
    """Short contexts decode in the padded batch (a gather of every row's slots, dequantized):
    each row's greedy answer is its answer alone."""
    prompts = [[(i * (31 + 2 * p)) % 4000 + 10 + p for i in range(40 + 9 * p)] for p in range(4)]
    llm = _int8(tiny_llama, fmt)
    alone = [llm.generate(p, GREEDY)[0].token_ids for p in prompts]
    llm.reset_prefix_cache()
    batch = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in batch] == alone
    llm.engine.check_integrity()
