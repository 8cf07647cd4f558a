"""Schema-free documents (engine/document_cache.py) on the tiny models: reuse in any order equals
the equivalent PML schema, a document right after its text equals the prefix cache, salts isolate,
segments describe the layout, and the pool stays consistent; last, the defects found reviewing
them, each reproduced before it was fixed."""

import random

import pytest
import torch

from kvreuse import LLM, SamplingParams
from kvreuse.engine.context import Segment, SegmentKind
from kvreuse.engine.document_cache import DocumentPrompt
from kvreuse.models.tiny import tiny_model
from tests.engine_helpers import LogitsSpy, step_to_end

GREEDY = SamplingParams(max_tokens=6, temperature=0)
ONE = SamplingParams(max_tokens=1, temperature=0)
DOCS = [
    "The lighthouse keeper on Varn island logs every passing ship in a green ledger.",
    "Copper kettles were traded for salt at the northern market every spring.",
    "A heron nests in the reeds beside the old mill, where the river bends twice.",
]
QUESTION = " Question: who keeps the green ledger?"


# the mechanics here are checked with repair off unless a request asks for one (the default
# repair, --document-blend-*, is tests/server/test_document_routes.py's)
NO_DEFAULT_REPAIR = {"document_blend_first_tokens": 0, "document_blend_ratio": 0.0, "document_blend_last_tokens": 0}


def make(loaded) -> LLM:
    return LLM(loaded=loaded, kv_cache_memory_gib=0.02, block_size=4, **NO_DEFAULT_REPAIR)


def schema_for(order: list[int]) -> str:
    """A PML schema holding the documents in ``order``, no text around them: each module is
    encoded attending only to itself, as a document encoded after no text is."""
    return (
        f'<schema name="s{"".join(map(str, order))}">'
        + "".join(f'<module name="d{i}">{DOCS[i]}</module>' for i in order)
        + "</schema>"
    )


def pml_run(loaded, order: list[int]):
    """(outputs, logits rows, stored token ids per module, question ids) through PML."""
    llm = make(loaded)
    llm.register_schema(schema_for(order))
    name = "s" + "".join(map(str, order))
    prompt = f'<prompt schema="{name}">' + "".join(f"<d{i}/>" for i in order) + f"{QUESTION}</prompt>"
    schema = llm.engine.modules.schemas[name]
    prepared = llm.engine.prepare_prompt(prompt)
    spy = LogitsSpy(llm)
    out = llm.generate(prompt, GREEDY)[0]
    stored = {i: list(schema.module(f"d{i}").stored_token_ids) for i in order}
    return out, spy.rows, stored, prepared.token_ids


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_documents_in_any_order_equal_pml(arch, request):
    """Documents first encoded in one order, then reused shifted in another: every logits row
    equals PML's over a schema in that order (<= 1e-4, fp32); greedy tokens equal."""
    loaded = request.getfixturevalue(arch)
    llm = make(loaded)
    for order in ([0, 1, 2], [2, 0, 1]):
        pml_out, pml_rows, stored, question = pml_run(loaded, order)
        prompt = DocumentPrompt.of([(stored[i], True) for i in order] + [(question, False)])
        spy = LogitsSpy(llm)
        out = llm.generate(prompt, GREEDY)[0]
        assert out.token_ids == pml_out.token_ids
        assert out.num_prompt_tokens == pml_out.num_prompt_tokens
        for a, b in zip(spy.rows, pml_rows, strict=True):
            assert (a - b).abs().max().item() <= 1e-4
        llm.engine.check_integrity()
    # the second order found every document cached (computed by the first), and only then
    assert out.num_cached_tokens == sum(len(s) for s in stored.values())
    assert llm.engine.documents.tokens_computed == sum(len(s) for s in stored.values())


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_document_right_after_its_text_equals_prefix_cache(arch, request):
    """One document right after the text it is encoded after (no shift): the logits equal
    the plain prompt's through the prefix cache (<= 1e-4)."""
    loaded = request.getfixturevalue(arch)
    tok = loaded.tokenizer
    head, doc, question = tok.encode("System: answer briefly."), tok.encode(DOCS[0]), tok.encode(QUESTION)
    llm = make(loaded)
    spy = LogitsSpy(llm)
    out = llm.generate(DocumentPrompt.of([(head, False), (doc, True), (question, False)]), GREEDY)[0]
    ref = make(loaded)
    ref_spy = LogitsSpy(ref)
    plain = ref.generate(head + doc + question, GREEDY)[0]
    assert out.token_ids == plain.token_ids
    for a, b in zip(spy.rows, ref_spy.rows, strict=True):
        assert (a - b).abs().max().item() <= 1e-4


def test_salt_isolates_documents(tiny_llama):
    tok = tiny_llama.tokenizer
    docs = [tok.encode(d) for d in DOCS]
    prompt = DocumentPrompt.of([(docs[0], True), (docs[1], True), (tok.encode(QUESTION), False)])
    n = len(docs[0]) + len(docs[1])
    llm = make(tiny_llama)
    first = llm.generate(prompt, GREEDY, cache_salt="tenant-a")[0]
    again = llm.generate(prompt, GREEDY, cache_salt="tenant-a")[0]
    other = llm.generate(prompt, GREEDY, cache_salt="tenant-b")[0]
    unsalted = llm.generate(prompt, GREEDY)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens, other.num_cached_tokens, unsalted.num_cached_tokens) == (
        0,
        n,
        0,
        0,
    )
    assert first.token_ids == again.token_ids == other.token_ids == unsalted.token_ids
    cache = llm.engine.documents
    keys = {salt: cache.keys(docs[0], (), salt)[0] for salt in ("tenant-a", "tenant-b", None)}
    assert len(set(keys.values())) == 3
    assert llm.engine.documents.tokens_computed == 3 * n
    llm.engine.check_integrity()


def test_segments_and_positions(tiny_llama):
    tok = tiny_llama.tokenizer
    head, a, b, q = tok.encode("System:"), tok.encode(DOCS[0]), tok.encode(DOCS[1]), tok.encode(QUESTION)
    llm = make(tiny_llama)
    engine = llm.engine
    engine.add_prepared_request("r", DocumentPrompt.of([(head, False), (a, True), (b, True), (q, False)]), GREEDY)
    seq = engine.scheduler.waiting[0]
    h, na, nb = len(head), len(a), len(b)
    assert seq.context.segments == (
        Segment(0, h, SegmentKind.TEXT, 0, 0),
        Segment(h, na, SegmentKind.DOCUMENT, h, h),
        Segment(h + na, nb, SegmentKind.DOCUMENT, h + na, h + na),
        Segment(h + na + nb, len(q), SegmentKind.TEXT, h + na + nb),
    )
    assert seq.context.positions == tuple(range(h + na + nb))
    assert seq.prompt_positions == list(range(h + na + nb, h + na + nb + len(q)))
    assert seq.prompt_token_ids == q
    engine.check_integrity()
    engine.abort_request("r")
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


def test_chat_marks_documents(tiny_llama):
    """``LLM.chat`` with messages marked as documents: the same reply as the plain chat when
    the documents sit where they were encoded; reordered, the documents are reused."""
    llm = make(tiny_llama)
    system = {"role": "system", "content": "Answer from the documents."}
    docs = [{"role": "user", "content": d, "kvreuse": {"document": True}} for d in DOCS[:2]]
    question = {"role": "user", "content": QUESTION}
    marked = llm.chat([system, docs[0], question], GREEDY)[0]
    plain = llm.chat([system, {"role": "user", "content": DOCS[0]}, question], GREEDY)[0]
    assert marked.token_ids == plain.token_ids
    llm.chat([system, docs[0], docs[1], question], GREEDY)
    swapped = llm.chat([system, docs[1], docs[0], question], GREEDY)[0]
    # the context (system text, documents, the template text between them) was all seen before;
    # only the text after the last document (the question and the generation prompt) is computed
    assert swapped.num_cached_tokens == swapped.num_prompt_tokens - len(
        own_ids(llm, [system, docs[1], docs[0], question])
    )
    assert 0 < len(own_ids(llm, [system, docs[1], docs[0], question])) < 20
    with pytest.raises(ValueError, match="kvreuse"):
        llm.chat([system, {**docs[0], "kvreuse": {"document": "yes"}}, question], GREEDY)
    llm.engine.check_integrity()


def own_ids(llm, messages) -> list[int]:
    """The tokens a chat with documents computes itself: the text after its last document."""
    return list(llm._chat_prompt(messages).layout().token_ids)


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_gemma3"])
def test_documents_fully_repaired_equal_full_prefill(arch, request):
    """Documents reused shifted, then every context token recomputed (``blend`` covering all):
    the logits are those of full prefill of the same tokens (<= 1e-4); the shared document
    blocks are not written; ``num_recomputed_tokens`` counts the context."""
    loaded = request.getfixturevalue(arch)
    tok = loaded.tokenizer
    head, question = tok.encode("System: answer briefly."), tok.encode(QUESTION)
    docs = [tok.encode(d) for d in DOCS]
    llm = make(loaded)
    llm.generate(
        DocumentPrompt.of([(head, False), (docs[0], True), (docs[1], True), (docs[2], True), (question, False)]), GREEDY
    )
    shuffled = DocumentPrompt.of([(head, False), (docs[2], True), (docs[0], True), (docs[1], True), (question, False)])
    kv_before = cached_kv(llm)
    spy = LogitsSpy(llm)
    out = llm.generate(shuffled, GREEDY, blend={"first_tokens": 10**6, "ratio": 1.0})[0]
    context = len(head) + sum(len(d) for d in docs)
    assert out.num_recomputed_tokens == context
    assert out.num_cached_tokens == 0  # every reused key was recomputed
    assert llm.engine.stats().seam_repair_tokens == context
    assert torch.equal(cached_kv(llm), kv_before)  # the documents' own (registered) blocks are unchanged
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0

    ref = make(loaded)
    ref_spy = LogitsSpy(ref)
    plain = ref.generate(head + docs[2] + docs[0] + docs[1] + question, GREEDY)[0]
    assert plain.token_ids == out.token_ids
    for a, b in zip(spy.rows, ref_spy.rows, strict=True):
        assert (a - b).abs().max().item() <= 1e-4

    unrepaired = make(loaded)
    unrepaired.generate(shuffled, SamplingParams(max_tokens=1, temperature=0))
    unrepaired_spy = LogitsSpy(unrepaired)
    unrepaired.generate(shuffled, SamplingParams(max_tokens=1, temperature=0))
    assert (unrepaired_spy.rows[0] - ref_spy.rows[0]).abs().max().item() > 1e-3  # the seams mattered


def test_documents_first_tokens_repair_counts_each_piece(tiny_llama):
    """``first_tokens`` k recomputes the first k keys of every context piece (the head text, each
    document, the text between); the reused count drops by as many."""
    tok = tiny_llama.tokenizer
    head, mid, question = tok.encode("System: answer."), tok.encode(" and "), tok.encode(QUESTION)
    docs = [tok.encode(d) for d in DOCS[:2]]
    prompt = DocumentPrompt.of([(head, False), (docs[1], True), (mid, False), (docs[0], True), (question, False)])
    llm = make(tiny_llama)
    llm.generate(prompt, GREEDY)
    k = 2
    out = llm.generate(prompt, GREEDY, blend={"first_tokens": k})[0]
    pieces = [head, docs[1], mid, docs[0]]
    assert out.num_recomputed_tokens == sum(min(k, len(p)) for p in pieces)
    assert out.num_cached_tokens == sum(len(p) for p in pieces) - out.num_recomputed_tokens
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0


def test_repair_takes_from_the_cached_count_only_keys_that_were_cached(tiny_llama):
    """Cached documents beside one computed now, ``first_tokens`` k: the k keys recomputed in the
    new document were never reused, so only the 2k recomputed in the head and the cached document
    leave ``num_cached_tokens`` (it was 2 short: every recomputed key was taken off)."""
    tok = tiny_llama.tokenizer
    head, question = tok.encode("System: answer."), tok.encode(QUESTION)
    docs = [tok.encode(d) for d in DOCS[:2]]
    llm = make(tiny_llama)
    llm.generate(DocumentPrompt.of([(head, False), (docs[0], True), (question, False)]), ONE)  # head, docs[0]
    mixed = DocumentPrompt.of([(head, False), (docs[0], True), (docs[1], True), (question, False)])
    k = 2
    out = llm.generate(mixed, ONE, blend={"first_tokens": k})[0]
    assert out.num_recomputed_tokens == 3 * k  # head, docs[0], docs[1]
    assert out.num_cached_tokens == len(head) + len(docs[0]) - 2 * k
    llm.engine.check_integrity()
    assert llm.engine.pool.num_used_blocks == 0


def cached_kv(llm: LLM) -> torch.Tensor:
    """Every cached (registered) block's KV: ``[layers, 2, kv_heads, slots, d]``."""
    bs = llm.engine.block_size
    ids = sorted(b.block_id for b in llm.engine.pool.cached_hashes())
    slots = torch.tensor([i * bs + o for i in ids for o in range(bs)])
    return llm.engine.runner.kv_cache[:, :, :, slots].clone()


def test_documents_evicted_to_the_host_tier_are_reused_from_it(tiny_llama):
    """A document's blocks are ordinary pool blocks: evicted, they go down to the host tier and
    come back on the next request that holds the document, as cached tokens, with the same logits."""
    llm = LLM(
        loaded=tiny_llama, kv_cache_memory_gib=0.00025, block_size=4, host_cache_memory_gib=0.001, **NO_DEFAULT_REPAIR
    )
    engine = llm.engine
    n = engine.pool.num_blocks
    doc = [(i * 37) % 4000 + 10 for i in range(4 * (n // 4))]  # whole blocks: every one can be cached
    question = [(i * 11) % 4000 + 5 for i in range(3)]
    prompt = DocumentPrompt.of([(doc, True), (question, False)])
    spy = LogitsSpy(llm)
    assert llm.generate(prompt, ONE)[0].num_cached_tokens == 0
    engine.check_integrity()
    for seed in (53, 59):  # two prompts as large as the pool: every document block is evicted
        llm.generate([(i * seed) % 4000 + 7 for i in range(4 * (n - 2))], ONE)
        engine.check_integrity()
    assert all(engine.pool.get_cached(k) is None for k in engine.documents.keys(doc, (), None))
    again = llm.generate(prompt, ONE)[0]
    engine.check_integrity()
    assert again.num_cached_tokens == len(doc)
    assert again.cached_tokens_by_tier == {"CPU": len(doc)}
    assert (spy.rows[-1] - spy.rows[0]).abs().max().item() <= 1e-4


def test_documents_are_read_in_place_repaired_or_not(tiny_llama):
    """On a model without sliding windows the context holds the documents' own blocks (no
    copies: the pool holds only those and the request's), each key with its shift (request
    position - encoded position); a repaired request holds them too, plus one private block
    for its recomputed tokens, whose keys stand at their positions (shift 0)."""
    tok = tiny_llama.tokenizer
    head, a, b, q = tok.encode("System:"), tok.encode(DOCS[0]), tok.encode(DOCS[1]), tok.encode(QUESTION)
    llm = make(tiny_llama)
    engine, bs = llm.engine, llm.engine.block_size
    prompt = DocumentPrompt.of([(head, False), (a, True), (b, True), (q, False)])
    engine.add_prepared_request("r", prompt, GREEDY)
    seq = engine.scheduler.waiting[0]
    h, na, nb = len(head), len(a), len(b)
    # the head is encoded after nothing (shift 0); each document after the head, at h..
    assert seq.context.shift_array.tolist() == [0] * h + [0] * na + [na] * nb
    doc_blocks = -(-h // bs) + -(-na // bs) + -(-nb // bs)
    assert engine.pool.num_used_blocks == doc_blocks  # no copies
    # the peak: computing a document holds its encoding text and cached leading blocks in scratch
    scratch = max(-(-(after + (-(-n // bs) - 1) * bs) // bs) for after, n in ((0, h), (h, na), (h, nb)))
    assert seq.context.capacity_blocks == (doc_blocks, doc_blocks + scratch)
    engine.check_integrity()
    engine.abort_request("r")
    engine.check_integrity()
    engine.add_prepared_request("p", prompt, GREEDY, blend={"first_tokens": 1, "ratio": 0, "last_tokens": 0})
    repaired = engine.scheduler.waiting[0]
    # first_tokens 1: the first token of the head, of a and of b recomputed into one private block
    assert repaired.context.shift_array.tolist() == [0] * h + [0] * na + [0] + [na] * (nb - 1)
    assert engine.pool.num_used_blocks == doc_blocks + 1
    private = {s // bs for s in repaired.context.slots} - {b.block_id for b in repaired.context.blocks[:doc_blocks]}
    assert len(private) == 1
    assert [repaired.context.slots[i] % bs for i in (0, h, h + na)] == [0, 1, 2]  # packed, in order
    engine.check_integrity()
    engine.abort_request("p")
    engine.check_integrity()
    assert engine.pool.num_used_blocks == 0


def test_in_place_documents_decode_alongside_others_as_alone(tiny_llama):
    """Two document requests (documents in other orders) and a plain one decoding in the same
    steps give exactly the tokens each gives alone."""
    tok = tiny_llama.tokenizer
    docs, q = [tok.encode(d) for d in DOCS], tok.encode(QUESTION)
    prompts = [DocumentPrompt.of([(docs[i], True) for i in order] + [(q, False)]) for order in ([0, 1, 2], [2, 1])]
    prompts.append(docs[0] + q)
    alone = [make(tiny_llama).generate(p, GREEDY)[0].token_ids for p in prompts]
    llm = make(tiny_llama)
    together = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in together] == alone
    llm.engine.check_integrity()


@pytest.mark.parametrize(
    "blend",
    [
        {"first_tokens": 1, "ratio": 0.0, "last_tokens": 1},
        {"first_tokens": 0, "ratio": 0.5, "last_tokens": 0},
        {"first_tokens": 2, "ratio": 0.3, "last_tokens": 2},
    ],
)
def test_repair_in_place_equals_repair_of_moved_copies(tiny_llama, monkeypatch, blend):
    """Seam repair over documents read in place (queries rotated per document, the recomputed
    tokens in private blocks, the deviation compared against keys rotated to their positions)
    gives what the same repair over moved copies gives: the same recomputed count, every logits
    row within 1e-4 (fp32), the same greedy tokens; nothing left held. Recomputed in chunks of 2
    tokens (each reading only the keys up to its last position), in place, it gives the same."""
    from kvreuse.engine import blend_pass
    from kvreuse.engine.document_cache import DocumentCache

    tok = tiny_llama.tokenizer
    prompt = DocumentPrompt.of(
        [(tok.encode("System:"), False)]
        + [(tok.encode(DOCS[i]), True) for i in (2, 0, 1)]
        + [(tok.encode(QUESTION), False)]
    )
    runs = {}
    for in_place in (True, False, "chunked"):
        llm = make(tiny_llama)
        if in_place == "chunked":
            monkeypatch.setattr(blend_pass, "RECOMPUTE_CHUNK_TOKENS", 2)
        if not in_place:  # the sliding-window models' path: every document copied to its positions
            real = DocumentCache.source
            monkeypatch.setattr(
                DocumentCache,
                "source",
                lambda self, layout, salt, in_place=True, **kw: real(self, layout, salt, in_place=False, **kw),
            )
        for order in ((0, 1, 2), (2, 0, 1)):  # encode each document once, then reuse it shifted
            llm.generate(
                DocumentPrompt.of([(tok.encode(DOCS[i]), True) for i in order] + [(tok.encode("?"), False)]), ONE
            )
        llm.engine.check_integrity()
        spy = LogitsSpy(llm)
        out = llm.generate(prompt, GREEDY, blend=blend)[0]
        llm.engine.check_integrity()
        assert llm.engine.pool.num_used_blocks == 0
        runs[in_place] = out, torch.stack(spy.rows)
        monkeypatch.undo()
    (in_place, rows), (copied, copied_rows), (chunked, chunked_rows) = runs[True], runs[False], runs["chunked"]
    assert chunked.token_ids == in_place.token_ids and chunked.num_recomputed_tokens == in_place.num_recomputed_tokens
    assert (chunked_rows - rows).abs().max().item() <= 1e-4
    assert in_place.num_recomputed_tokens == copied.num_recomputed_tokens > 0
    assert in_place.num_cached_tokens == copied.num_cached_tokens
    assert in_place.token_ids == copied.token_ids
    assert (rows - copied_rows).abs().max().item() <= 1e-4


def test_in_place_capacity_counts_a_fill_s_scratch(tiny_llama):
    """Read in place, an acquisition holds the documents' blocks and, while a document is
    computed, its encoding text and cached leading blocks in scratch beside them: the capacity
    check counts that peak, so a request that could never acquire is refused up front naming
    the setting, and one with room for exactly the peak runs (review: it waited forever)."""
    per_block = 4 * make(tiny_llama).engine.runner.layout.bytes_per_token(torch.float32)
    head = [11 + i for i in range(16)]  # 4 blocks: the text the document is encoded after
    document = [300 + i for i in range(60)]  # 15 blocks
    prompt = DocumentPrompt.of([(head, False), (document, True), ([7], False)])
    # held: 4 + 15 blocks; computing the document: 18 scratch blocks (16 head + 14 blocks) beside them
    peak = 4 + 15 + 18
    small = LLM(loaded=tiny_llama, kv_cache_memory_gib=20 * per_block / 2**30, block_size=4, **NO_DEFAULT_REPAIR)
    with pytest.raises(ValueError, match="kv-cache-memory"):
        small.engine.add_prepared_request("r", prompt, ONE)
    small.engine.check_integrity()
    assert small.engine.pool.num_used_blocks == 0
    exact = LLM(loaded=tiny_llama, kv_cache_memory_gib=peak * per_block / 2**30, block_size=4, **NO_DEFAULT_REPAIR)
    assert exact.engine.pool.num_blocks == peak
    out = exact.generate(prompt, ONE)[0]
    assert len(out.token_ids) == 1
    exact.engine.check_integrity()
    assert exact.engine.pool.num_used_blocks == 0


def test_a_decoding_request_moves_its_in_place_context_to_one_run(tiny_llama):
    """Once its prompt is done, a request over documents read in place decodes over one moved
    copy of its context (no shifts; its own blocks, one run), the documents' blocks let go (still
    cached for the next request); every logits row equals the same request over moved copies
    from the start (1e-4) and nothing stays held."""
    from kvreuse.engine.document_cache import DocumentCache

    tok = tiny_llama.tokenizer
    docs, q = [tok.encode(d) for d in DOCS], tok.encode(QUESTION)
    prompt = DocumentPrompt.of([(docs[i], True) for i in (2, 0, 1)] + [(q, False)])
    llm = make(tiny_llama)
    engine, bs = llm.engine, llm.engine.block_size
    llm.generate(DocumentPrompt.of([(d, True) for d in docs] + [(q, False)]), ONE)  # encoded in another order
    spy = LogitsSpy(llm)
    engine.add_prepared_request("r", prompt, GREEDY)
    (seq,) = engine.requests()
    engine.step()  # the prompt, over the documents in place
    assert seq.context.shift_array is not None and not seq.is_prefill
    doc_blocks = {b.block_id for b in seq.context.blocks}
    engine.step()  # the first decode step moves the context first
    engine.check_integrity()
    assert seq.context.shift_array is None
    n = sum(len(d) for d in docs)
    assert len(seq.context.blocks) == -(-n // bs) and not doc_blocks & {b.block_id for b in seq.context.blocks}
    assert seq.context.slot_array.tolist() == [b.block_id * bs + i for b in seq.context.blocks for i in range(bs)][:n]
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.pool.num_used_blocks == 0
    rows = torch.stack(spy.rows)

    ref = make(tiny_llama)
    real = DocumentCache.source
    DocumentCache.source = lambda self, layout, salt, in_place=True, **kw: real(
        self, layout, salt, in_place=False, **kw
    )
    try:
        ref.generate(DocumentPrompt.of([(d, True) for d in docs] + [(q, False)]), ONE)
        ref_spy = LogitsSpy(ref)
        ref.generate(prompt, GREEDY)
    finally:
        DocumentCache.source = real
    assert len(spy.rows) == len(ref_spy.rows) == GREEDY.max_tokens
    assert (rows - torch.stack(ref_spy.rows)).abs().max().item() <= 1e-4


# Defects found reviewing schema-free documents (each reproduced before it was fixed): a rope
# type that cannot be shifted leaked the request's copies; the capacity check depended on the load
# at arrival; out-of-vocabulary document ids raised IndexError and left the batch queued; a
# non-dict mark crashed LLM.chat; repair dropped the segments; a re-acquisition counted the
# request's own documents as cached.


def ids(rng, n):
    return [rng.randrange(3, 40000) for _ in range(n)]


def ledger_prompt(tok):
    return DocumentPrompt.of(
        [
            (tok.encode("System: answer briefly."), False),
            (tok.encode(DOCS[0]), True),
            (tok.encode(DOCS[1]), True),
            (tok.encode(" Who keeps the ledger?"), False),
        ]
    )


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
        engine = LLM(
            loaded=tiny_llama, kv_cache_memory_gib=(4 * 120 * bpt) / 2**30, block_size=4, **NO_DEFAULT_REPAIR
        ).engine
        if busy:  # another request holds blocks when this one arrives: its context cannot be held now
            engine.add_request("other", ids(rng, 300), SamplingParams(max_tokens=5, temperature=0))
            engine.step()
        engine.add_prepared_request("doc", prompt_, params)  # accepted either way
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
    assert llm.engine.documents.tokens_computed == 3  # only the good ledger_prompt's 3-token document, once


def test_a_mark_that_is_not_an_object_is_a_value_error_in_llm_chat(tiny_llama):
    llm = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.02, block_size=4, **NO_DEFAULT_REPAIR)
    with pytest.raises(ValueError, match="kvreuse"):
        llm.chat([{"role": "user", "content": DOCS[0], "kvreuse": True}, {"role": "user", "content": "Q?"}], ONE)
    out = llm.chat(
        [{"role": "user", "content": DOCS[0], "kvreuse": {"document": False}}, {"role": "user", "content": "Q?"}], ONE
    )[0]  # an explicit false: a plain chat
    assert (
        out.token_ids
        == llm.chat([{"role": "user", "content": DOCS[0]}, {"role": "user", "content": "Q?"}], ONE)[0].token_ids
    )


def test_repair_keeps_the_segments(tiny_llama):
    engine = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.02, block_size=4, **NO_DEFAULT_REPAIR).engine
    engine.add_prepared_request("plain", ledger_prompt(tiny_llama.tokenizer), ONE)
    engine.add_prepared_request("rep", ledger_prompt(tiny_llama.tokenizer), ONE, blend={"first_tokens": 1})
    seqs = {s.request_id: s for s in engine.requests()}
    assert len(seqs["plain"].context.segments) == 4  # head text, two documents, the question
    assert seqs["rep"].context.segments == seqs["plain"].context.segments


@pytest.mark.parametrize("blend", [None, {"first_tokens": 1}])
def test_a_reacquired_context_counts_only_what_the_first_acquisition_found(tiny_llama, blend):
    """A context let go and acquired again (a waiting request under pressure) finds the request's
    own freshly computed documents cached; they are not reported as cached tokens."""
    engine = LLM(loaded=tiny_llama, kv_cache_memory_gib=0.02, block_size=4, **NO_DEFAULT_REPAIR).engine
    engine.add_prepared_request("r", ledger_prompt(tiny_llama.tokenizer), ONE, blend=blend)
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
    real = llm.engine.blend_pass.recompute
    monkeypatch.setattr(llm.engine.blend_pass, "recompute", lambda *a, **k: (time.sleep(0.3), real(*a, **k))[1])
    out = llm.generate(ledger_prompt(tiny_llama.tokenizer), ONE, blend={"first_tokens": 1})[0]
    assert out.num_recomputed_tokens == 3 and out.ttft_s >= 0.3  # one per piece: head text, two documents
