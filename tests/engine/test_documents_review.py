"""Defects found reviewing schema-free documents (each reproduced before it was fixed): a rope
type that cannot be shifted leaked the request's copies; the capacity check depended on the load
at arrival; out-of-vocabulary document ids raised IndexError and left the batch queued; a
non-dict mark crashed LLM.chat; repair dropped the segments; a re-acquisition counted the
request's own documents as cached."""

import random

import pytest

from kvreuse import LLM, SamplingParams
from kvreuse.engine.document_cache import DocumentPrompt
from kvreuse.models.tiny import tiny_model
from tests.engine_helpers import step_to_end
from tests.engine.test_documents import NO_DEFAULT_REPAIR

DOCS = ["The lighthouse keeper on Varn island logs every passing ship in a green ledger.",
        "Copper kettles were traded for salt at the northern market every spring."]
ONE = SamplingParams(max_tokens=1, temperature=0)


def ids(rng, n):
    return [rng.randrange(3, 40000) for _ in range(n)]


def prompt(tok):
    return DocumentPrompt.of([(tok.encode("System: answer briefly."), False), (tok.encode(DOCS[0]), True),
                              (tok.encode(DOCS[1]), True), (tok.encode(" Who keeps the ledger?"), False)])


def test_an_unshiftable_rope_type_is_refused_before_any_work():
    m = tiny_model("llama", seed=0)
    m.model.model.rotary_emb.rope_type = "dynamic"  # as a rope_scaling={"rope_type": "dynamic"} checkpoint
    llm = LLM(loaded=m, kv_cache_memory_gib=0.02, block_size=4, **NO_DEFAULT_REPAIR)
    rng = random.Random(0)
    with pytest.raises(ValueError, match="rope type"):
        llm.generate(DocumentPrompt.of([(ids(rng, 10), False), (ids(rng, 13), True), (ids(rng, 5), False)]), ONE)
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0 and llm.engine.documents.tokens_computed == 0


def test_the_capacity_check_does_not_depend_on_the_load_at_arrival(tiny_llama):
    rng = random.Random(2)
    prompt_ = DocumentPrompt.of([(ids(rng, 100), True), (ids(rng, 100), True), (ids(rng, 10), False)])
    params = SamplingParams(max_tokens=90, temperature=0)
    bpt = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.01, block_size=4).engine.kv_bytes_per_token
    for busy in (False, True):
        engine = LLM(loaded=tiny_llama, kv_cache_memory_gib=(4 * 120 * bpt) / 2**30, block_size=4, **NO_DEFAULT_REPAIR).engine
        if busy:  # another request holds blocks when this one arrives: its context cannot be held now
            engine.add_request("other", ids(rng, 300), SamplingParams(max_tokens=5, temperature=0))
            engine.step()
        engine.add_document_request("doc", prompt_, params)  # accepted either way
        done = step_to_end(engine)
        assert done["doc"].finished and len(done["doc"].output_token_ids) == 90
        assert engine.pool.num_used_blocks == 0


def test_out_of_vocabulary_document_ids_are_a_value_error_and_leave_nothing_queued(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.02, block_size=4, **NO_DEFAULT_REPAIR)
    vocab = llm.engine.loaded.shape.vocab_size
    good = DocumentPrompt.of([([11, 12, 13], True), ([9, 10], False)])
    for bad in (vocab + 5, -1):
        with pytest.raises(ValueError, match="documents"):
            llm.generate([good, DocumentPrompt.of([([bad], True), ([9], False)])], ONE)
        assert not llm.engine.has_unfinished_requests()
        llm.engine.check_integrity()
    assert llm.engine.documents.tokens_computed == 3  # only the good prompt's 3-token document, once


def test_a_mark_that_is_not_an_object_is_a_value_error_in_llm_chat(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.02, block_size=4, **NO_DEFAULT_REPAIR)
    with pytest.raises(ValueError, match="kvreuse"):
        llm.chat([{"role": "user", "content": DOCS[0], "kvreuse": True}, {"role": "user", "content": "Q?"}], ONE)
    out = llm.chat([{"role": "user", "content": DOCS[0], "kvreuse": {"document": False}},
                    {"role": "user", "content": "Q?"}], ONE)[0]  # an explicit false: a plain chat
    assert out.token_ids == llm.chat([{"role": "user", "content": DOCS[0]}, {"role": "user", "content": "Q?"}],
                                     ONE)[0].token_ids


def test_repair_keeps_the_segments(tiny_llama):
    engine = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.02, block_size=4, **NO_DEFAULT_REPAIR).engine
    engine.add_document_request("plain", prompt(tiny_llama.tokenizer), ONE)
    engine.add_document_request("rep", prompt(tiny_llama.tokenizer), ONE, blend={"first_tokens": 1})
    seqs = {s.request_id: s for s in engine.requests()}
    assert len(seqs["plain"].context.segments) == 4  # head text, two documents, the question
    assert seqs["rep"].context.segments == seqs["plain"].context.segments


@pytest.mark.parametrize("blend", [None, {"first_tokens": 1}])
def test_a_reacquired_context_counts_only_what_the_first_acquisition_found(tiny_llama, blend):
    """A context let go and acquired again (a waiting request under pressure) finds the request's
    own freshly computed documents cached; they are not reported as cached tokens."""
    engine = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.02, block_size=4, **NO_DEFAULT_REPAIR).engine
    engine.add_document_request("r", prompt(tiny_llama.tokenizer), ONE, blend=blend)
    (seq,) = engine.requests()
    assert engine.documents.tokens_computed > 0
    seq.context.release()
    assert seq.context.acquire()
    engine.check_integrity()
    outs = step_to_end(engine)
    assert outs["r"].num_cached_tokens == 0


def test_ttft_includes_the_context_acquisition_and_repair(tiny_llama, monkeypatch):
    """ttft_s starts when the request is added, before its documents are copied and repaired
    (it started after them; review: reproduced with a slowed recompute)."""
    import time

    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.02, block_size=4, **NO_DEFAULT_REPAIR)
    real = llm.engine.runner.recompute
    monkeypatch.setattr(llm.engine.runner, "recompute", lambda *a, **k: (time.sleep(0.3), real(*a, **k))[1])
    out = llm.generate(prompt(tiny_llama.tokenizer), ONE, blend={"first_tokens": 1})[0]
    assert out.num_recomputed_tokens == 3 and out.ttft_s >= 0.3  # one per piece: head text, two documents
