"""Schema-free documents over HTTP, driven by the official ``openai`` client against a live
server (tiny random Llama): chat messages marked ``"kvreuse": {"document": true}`` and the
completions ``documents`` field are reused in any order, ``cached_tokens`` reports the reused
context, ``blend`` repairs the seams, salts isolate, and bad marks are 400s naming the field."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .fresh_app import fresh_server

DOCS = [
    "The lighthouse keeper on Varn island logs every passing ship in a green ledger.",
    "Copper kettles were traded for salt at the northern market every spring.",
    "A heron nests in the reeds beside the old mill, where the river bends twice.",
]
SYSTEM = {"role": "system", "content": "Answer from the documents."}
QUESTION = {"role": "user", "content": "Who keeps the green ledger?"}
# the mechanics below are checked with repair off unless a request asks for one; the default
# repair is checked on its own (test_documents_get_the_default_repair_unless_they_ask_otherwise)
NO_DEFAULT_REPAIR = {"document_blend_first_tokens": 0, "document_blend_ratio": 0.0, "document_blend_last_tokens": 0}
CONFIG = {"kv_cache_memory_gib": 0.02, "max_model_len": 1024, **NO_DEFAULT_REPAIR}


def doc(i: int) -> dict:
    return {"role": "user", "content": DOCS[i], "kvreuse": {"document": True}}


def plain(i: int) -> dict:
    return {"role": "user", "content": DOCS[i]}


@pytest.fixture
def served(tiny_llama):
    import openai

    with fresh_server(tiny_llama, **CONFIG) as (url, engine):
        yield openai.OpenAI(base_url=url + "/v1", api_key="none"), url, engine


def chat(client, messages, **extra):
    return client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, extra_body=extra or None
    )


def own_tokens(engine, messages) -> int:
    """Tokens a chat with documents computes itself: the text after its last document."""
    from kvreuse.api.chat_prompt import render_chat
    from kvreuse.api.protocol import ChatMessage

    rendered = render_chat(engine.tokenizer, [ChatMessage(**m) for m in messages])
    return len(rendered.documents.layout().token_ids)


def test_chat_documents_reused_in_any_order(served):
    client, url, engine = served
    # one document right after the text it is encoded after (the system turn): plain chat's reply
    one = chat(client, [SYSTEM, doc(0), QUESTION])
    assert one.choices[0].message.content == chat(client, [SYSTEM, plain(0), QUESTION]).choices[0].message.content
    first = chat(client, [SYSTEM, doc(0), doc(1), doc(2), QUESTION])
    assert (
        first.usage.prompt_tokens_details.cached_tokens
        == one.usage.prompt_tokens_details.cached_tokens
        + one.usage.prompt_tokens
        - own_tokens(engine, [SYSTEM, doc(0), QUESTION])
    )  # the system turn and doc 0
    reused = [one.usage.prompt_tokens_details.cached_tokens, first.usage.prompt_tokens_details.cached_tokens]
    for order in ([2, 0, 1], [1, 2, 0], [2, 1]):
        messages = [SYSTEM, *map(doc, order), QUESTION]
        out = chat(client, messages)
        reused.append(out.usage.prompt_tokens_details.cached_tokens)
        # every piece of the context was computed before (the documents, the template text
        # between them, the system turn): only the text after the last document is computed
        assert out.usage.prompt_tokens_details.cached_tokens == out.usage.prompt_tokens - own_tokens(engine, messages)
    stats = engine.stats()
    metrics = httpx.get(url + "/metrics").text
    assert stats.document_tokens_reused == sum(reused)  # each context piece found cached, as usage said
    assert stats.document_tokens_computed > 0
    assert f'kvreuse:document_tokens_reused_total{{model_name="tiny"}} {float(stats.document_tokens_reused)}' in metrics
    assert (
        f'kvreuse:document_tokens_computed_total{{model_name="tiny"}} {float(stats.document_tokens_computed)}'
        in metrics
    )
    asyncio.run(engine.check_integrity())


def test_chat_documents_full_repair_equals_plain_chat(served):
    """Shuffled documents with every context token recomputed give the plain chat's reply in
    that order; usage says how many were recomputed; the counter matches."""
    client, url, engine = served
    chat(client, [SYSTEM, doc(0), doc(1), doc(2), QUESTION])
    messages = [SYSTEM, doc(2), doc(0), doc(1), QUESTION]
    repaired = chat(client, messages, blend={"first_tokens": 10**6, "ratio": 1.0})
    reference = chat(client, [SYSTEM, plain(2), plain(0), plain(1), QUESTION])
    assert repaired.choices[0].message.content == reference.choices[0].message.content
    context = repaired.usage.prompt_tokens - own_tokens(engine, messages)
    details = repaired.usage.prompt_tokens_details
    assert details.cached_tokens == 0 and details.model_extra["recomputed_tokens"] == context
    metrics = httpx.get(url + "/metrics").text
    assert f'kvreuse:seam_repair_tokens_total{{model_name="tiny"}} {float(context)}' in metrics
    streamed = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"blend": {"first_tokens": 10**6, "ratio": 1.0}},
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == repaired.choices[0].message.content
    )
    asyncio.run(engine.check_integrity())


def test_completions_documents_field(served):
    client, _, engine = served
    kwargs = {"model": "tiny", "prompt": " Question: who keeps the green ledger?", "max_tokens": 6, "temperature": 0}
    first = client.completions.create(**kwargs, extra_body={"documents": DOCS})
    again = client.completions.create(**kwargs, extra_body={"documents": [DOCS[2], DOCS[0], DOCS[1]]})
    tokenizer = engine.tokenizer
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == sum(len(tokenizer.encode(d)) for d in DOCS)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    # one document first (encoded after nothing, unshifted): the plain prompt's reply
    single = client.completions.create(**kwargs, extra_body={"documents": [DOCS[1]]})
    assert single.usage.prompt_tokens_details.cached_tokens == len(tokenizer.encode(DOCS[1]))
    flat = tokenizer.encode(DOCS[1]) + tokenizer.encode(kwargs["prompt"])
    assert client.completions.create(**{**kwargs, "prompt": flat}).choices[0].text == single.choices[0].text
    asyncio.run(engine.check_integrity())


def test_documents_get_the_default_repair_unless_they_ask_otherwise(tiny_llama):
    """At the server's defaults a chat's documents are seam-repaired (``--document-blend-*``:
    first 1, ratio 0, last 1): usage counts the recomputed keys, taken from the cached ones;
    ``blend`` all 0 turns it off for the request (every context key reused); PML keeps
    ``--blend-*`` (0: off)."""
    import openai

    from kvreuse.engine.config import EngineConfig

    assert (
        EngineConfig().document_blend.first_tokens,
        EngineConfig().document_blend.ratio,
        EngineConfig().document_blend.last_tokens,
    ) == (1, 0.0, 1)
    assert not EngineConfig().blend.enabled
    with fresh_server(tiny_llama, kv_cache_memory_gib=0.02, max_model_len=1024) as (url, engine):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        chat(client, [SYSTEM, doc(0), doc(1), doc(2), QUESTION])  # every document computed once
        messages = [SYSTEM, doc(2), doc(0), doc(1), QUESTION]
        context = chat(client, messages, blend={"first_tokens": 0, "ratio": 0, "last_tokens": 0}).usage
        assert context.prompt_tokens_details.model_extra.get("recomputed_tokens", 0) == 0
        reused = context.prompt_tokens_details.cached_tokens
        assert reused == context.prompt_tokens - own_tokens(engine, messages)
        default = chat(client, messages).usage.prompt_tokens_details
        # the first and last token of each piece: the system turn's text and the 3 documents
        assert default.model_extra["recomputed_tokens"] == 2 * 4
        assert default.cached_tokens + default.model_extra["recomputed_tokens"] == reused
        asyncio.run(engine.check_integrity())


def test_documents_isolated_by_salt(served):
    client, _, _ = served
    messages = [SYSTEM, doc(0), doc(1), QUESTION]
    a = chat(client, messages, cache_salt="tenant-a")
    a2 = chat(client, messages, cache_salt="tenant-a")
    b = chat(client, messages, cache_salt="tenant-b")
    unsalted = chat(client, messages)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (a, a2, b, unsalted)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2:] == [0, 0]
    assert len({r.choices[0].message.content for r in (a, a2, b, unsalted)}) == 1


@pytest.mark.parametrize(
    "messages, extra, needle",
    [
        ([SYSTEM, {**plain(0), "kvreuse": {"document": "yes"}}, QUESTION], {}, "kvreuse"),
        ([SYSTEM, {**plain(0), "kvreuse": {"doc": True}}, QUESTION], {}, "kvreuse"),
        ([SYSTEM, doc(0)], {"add_generation_prompt": False}, "document"),  # nothing after the document
    ],
)
def test_bad_document_marks_are_400s(served, messages, extra, needle):
    import openai

    client, _, engine = served
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, messages, **extra)
    assert needle in str(err.value)
    assert chat(client, [SYSTEM, doc(0), QUESTION]).choices  # the server still serves
    asyncio.run(engine.check_integrity())


def test_bad_completions_documents_are_400s(served):
    import openai

    client, _, _ = served
    for extra, needle in (
        ({"documents": [""]}, "document"),
        ({"documents": "one"}, "documents"),
        ({"documents": [DOCS[0]], "blend": {"ratio": 2}}, "blend.ratio"),
    ):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tiny", prompt="Q?", max_tokens=2, extra_body=extra)
        assert needle in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt=["Q1?", "Q2?"], max_tokens=2, extra_body={"documents": DOCS})
    assert "documents" in str(err.value)


def test_review_400s_name_the_documents_part_and_content_part_marks(served):
    """A bad id in completions documents is a 400 naming documents[i]; a kvreuse mark on a content
    part is refused (it would reuse nothing), naming messages (review: reproduced)."""
    _, url, engine = served
    r = httpx.post(
        url + "/v1/completions",
        json={"model": "tiny", "prompt": " Q?", "max_tokens": 2, "documents": ["fine", [-1, 5]]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "documents[1]", r.json()
    part = {"role": "user", "content": [{"type": "text", "text": DOCS[0], "kvreuse": {"document": True}}]}
    r = httpx.post(
        url + "/v1/chat/completions", json={"model": "tiny", "messages": [SYSTEM, part, QUESTION], "max_tokens": 2}
    )
    assert r.status_code == 400 and "content part" in r.json()["error"]["message"], r.json()
    asyncio.run(engine.check_integrity())


def test_chat_with_documents_and_no_max_tokens_fills_the_pool(tiny_llama):
    """Without max_tokens the reply may fill the pool (as for plain chat); the documents sit in
    blocks of their own, and the default counts that rounding (it was a 400; review: reproduced)."""
    from .fresh_app import fresh_client

    bpt = tiny_llama.kv_bytes_per_token() if callable(tiny_llama.kv_bytes_per_token) else tiny_llama.kv_bytes_per_token
    with fresh_client(tiny_llama, kv_cache_memory_gib=(4 * 100 * bpt) / 2**30, block_size=4, max_model_len=1024) as (
        c,
        engine,
    ):
        for k in range(4):  # every context length mod the block size
            msgs = [{"role": "system", "content": "word " * k}, doc(0), doc(1), QUESTION]
            r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "temperature": 0})
            assert r.status_code == 200, r.json()
            assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")
            asyncio.run(engine.check_integrity())


def test_chat_documents_last_tokens_repair(served):
    """``blend.last_tokens`` over HTTP: covering every token it is full prefill in the shuffled
    order (usage counts each context token once); a bad value is a 400 naming the field."""
    import openai

    client, _, engine = served
    chat(client, [SYSTEM, doc(0), doc(1), doc(2), QUESTION])
    messages = [SYSTEM, doc(1), doc(2), doc(0), QUESTION]
    repaired = chat(client, messages, blend={"last_tokens": 10**6})
    reference = chat(client, [SYSTEM, plain(1), plain(2), plain(0), QUESTION])
    assert repaired.choices[0].message.content == reference.choices[0].message.content
    context = repaired.usage.prompt_tokens - own_tokens(engine, messages)
    assert repaired.usage.prompt_tokens_details.model_extra["recomputed_tokens"] == context
    one = chat(client, messages, blend={"last_tokens": 1})
    assert 0 < one.usage.prompt_tokens_details.model_extra["recomputed_tokens"] < context
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, messages, blend={"last_tokens": -1})
    assert "blend.last_tokens" in str(err.value)
    asyncio.run(engine.check_integrity())


@pytest.mark.parametrize("repair", [NO_DEFAULT_REPAIR, {}], ids=["no-repair", "default-repair"])
def test_no_max_tokens_counts_the_blocks_the_engine_counts(tiny_llama, repair):
    """A pool smaller than the model's context: the default max_tokens leaves out what the
    documents' context holds as the engine counts it (each piece in blocks of its own, read in
    place, plus repair's private blocks), so a chat or a completion without max_tokens runs
    (review: a 400 "needs 14 KV blocks ... the pool has 13" when one copied run was assumed)."""
    from .fresh_app import fresh_client

    msgs = [SYSTEM, doc(0), doc(1), QUESTION]
    with fresh_client(tiny_llama, kv_cache_memory_gib=0.0001, max_model_len=4096, **repair) as (c, engine):
        assert engine.pool_tokens < 4096
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": msgs, "temperature": 0})
        assert r.status_code == 200, r.json()
        r = c.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "Who keeps the green ledger?", "documents": DOCS[:2], "temperature": 0},
        )
        assert r.status_code == 200, r.json()
        asyncio.run(engine.check_integrity())


def test_completions_documents_put_bos_once_at_the_start():
    """A tokenizer that adds BOS to a prompt (Gemma 3's): the documents request gets it once,
    as a text part before the first document (what every document is encoded after), and no
    document nor the question carries its own; token-id parts are taken as given. A tokenizer
    that adds nothing (the tiny models') gets no extra part."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from kvreuse.api.chat_prompt import special_lead
    from kvreuse.api.protocol import CompletionRequest
    from kvreuse.models.loader import prepare_folder
    from kvreuse.models.tiny import tiny_model
    from kvreuse.server.completions_routes import _documents

    gemma = AutoTokenizer.from_pretrained(str(prepare_folder("gemma3-270m")[1]), local_files_only=True)
    assert special_lead(gemma) == [gemma.bos_token_id] == [2]

    def parts(tokenizer, documents, question):
        ctx = SimpleNamespace(engine=SimpleNamespace(tokenizer=tokenizer, vocab_size=len(tokenizer)))
        body = CompletionRequest(model="m", prompt=question, documents=documents)
        return [(list(ids), is_doc) for ids, is_doc in _documents(ctx, body, [question]).parts]

    def bare(tokenizer, text):
        return tokenizer.encode(text, add_special_tokens=False)

    q = " Question: who keeps the green ledger?"
    assert parts(gemma, DOCS[:2], q) == [
        ([2], False),
        (bare(gemma, DOCS[0]), True),
        (bare(gemma, DOCS[1]), True),
        (bare(gemma, q), False),
    ]
    assert 2 not in bare(gemma, DOCS[0]) + bare(gemma, q)
    ids = bare(gemma, DOCS[0])
    assert parts(gemma, [ids], q) == [(ids, True), (bare(gemma, q), False)]  # token ids: as given
    both = AutoTokenizer.from_pretrained(
        str(prepare_folder("gemma3-270m")[1]), local_files_only=True, add_bos_token=True, add_eos_token=True
    )
    assert both.encode("a")[-1] == both.eos_token_id and special_lead(both) == [2]  # the EOS is not a lead
    tiny = tiny_model("llama").tokenizer
    assert special_lead(tiny) == []
    assert parts(tiny, DOCS[:1], q) == [(tiny.encode(DOCS[0]), True), (tiny.encode(q), False)]


def test_chat_document_parts_split_a_rendered_bos_off_the_first_document():
    """A template that renders BOS puts it in the first message's range: when that message is
    a document, BOS becomes a text part of its own (every document is then encoded after it);
    a first text message, or no lead, leaves the parts as they were."""
    from kvreuse.api.chat_prompt import document_parts

    def parts(*args):
        return [(list(t), d) for t, d in document_parts(*args).parts]

    ids = [2, 10, 11, 12, 20, 21, 30]  # BOS + document 0, document 1, generation prompt
    bounds, flags = [(0, 4), (4, 6)], [True, True]
    assert parts(ids, bounds, flags, [2]) == [([2], False), ([10, 11, 12], True), ([20, 21], True), ([30], False)]
    assert parts(ids, bounds, flags) == [([2, 10, 11, 12], True), ([20, 21], True), ([30], False)]
    assert parts(ids, bounds, [False, True], [2]) == [([2, 10, 11, 12], False), ([20, 21], True), ([30], False)]


@pytest.mark.parametrize("adds_bos", [True, False])
def test_chat_documents_on_a_template_that_renders_bos(adds_bos):
    """Gemma 3's tokenizer with a template starting ``{{ bos_token }}`` and a document first:
    the BOS is a text part of its own whether the tokenizer adds it to a prompt or not, so
    both documents are encoded after it; the parts join back to the rendered ids."""
    from transformers import AutoTokenizer

    from kvreuse.api.chat_prompt import render_chat
    from kvreuse.api.protocol import ChatMessage
    from kvreuse.models.loader import prepare_folder

    tok = AutoTokenizer.from_pretrained(
        str(prepare_folder("gemma3-270m")[1]), local_files_only=True, add_bos_token=adds_bos
    )
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
        "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    )
    messages = [ChatMessage(**doc(0)), ChatMessage(**doc(1)), ChatMessage(**QUESTION)]
    prompt = render_chat(tok, messages)
    layout = prompt.documents.layout()
    assert prompt.token_ids[0] == 2 and prompt.documents.parts[0] == ((2,), False)
    assert layout.after == (2,) and [t for ids, _ in prompt.documents.parts for t in ids] == prompt.token_ids
