"""Message boundaries of a rendered chat (kvreuse.api.chat_prompt): counted from one encoding
with character offsets, they equal tokenizing every prefix, on the tiny model's tokenizer (the
default model's, with its chat template) over random chats, including ones whose message ends
fall inside a token."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings, strategies as st

from kvreuse.api import chat_prompt
from kvreuse.api.chat_prompt import message_boundaries

BODIES = st.sampled_from(
    [
        "",
        " ",
        "x",
        "héllo  wörld\n\n",
        "aaaa",
        "<|im_end|>",
        "  trailing ",
        "1234 5678",
        "line\nline\n",
        "\t\tTabs",
        "emoji 🙂 and more",
    ]
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies=st.lists(BODIES, min_size=1, max_size=6), system=st.booleans())
def test_offsets_give_the_boundaries_tokenizing_every_prefix_gives(tiny_llama, bodies, system):
    tok = tiny_llama.tokenizer
    msgs = ([{"role": "system", "content": "Be brief."}] if system else []) + [
        {"role": "user" if i % 2 == 0 else "assistant", "content": b} for i, b in enumerate(bodies)
    ]
    text = chat_prompt._render_text(tok, msgs, add_generation_prompt=True, template_kwargs={})
    n = len(tok.encode(text, add_special_tokens=False))
    assert chat_prompt._token_spans(tok, text) is not None  # the offsets path is the one under test
    assert message_boundaries(tok, msgs, n, {}, text) == message_boundaries(tok, msgs, n, {})


def test_a_prefix_ending_inside_a_token_is_not_aligned():
    text = "abcdef"
    spans = ([0, 3], [3, 6], [False, True])  # tokens "abc", "def" (a special one)
    assert chat_prompt._aligned_count(spans, text, "abc") == 1
    assert chat_prompt._aligned_count(spans, text, "abcd") is None  # "def" straddles the end
    assert chat_prompt._aligned_count(spans, text, "abx") is None  # not a prefix of the prompt
    assert chat_prompt._aligned_count(spans, text, "abcdef") == 2
    plain = ([0, 3], [3, 6], [False, False])
    assert chat_prompt._aligned_count(plain, text, "abc") is None  # plain text follows: tokenized itself


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies=st.lists(BODIES, min_size=1, max_size=5))
def test_a_template_with_plain_text_after_a_message_gives_the_per_prefix_boundaries(tiny_llama, bodies):
    """An Alpaca-style template puts plain text (no special token) after each message: byte-level
    pre-tokenization splits a message's trailing whitespace by what follows it, so a boundary of
    the whole prompt is not one of the prefix; the boundaries still equal tokenizing every prefix
    (review: "Sure. " then "\n\n### Instruction" differed by a token)."""
    tok = tiny_llama.tokenizer
    template = tok.chat_template
    tok.chat_template = (
        "{% for m in messages %}{% if m['role']=='user' %}### Instruction:\n{{ m['content'] }}\n\n"
        "### Response:\n{% else %}{{ m['content'] }}\n\n{% endif %}{% endfor %}"
    )
    try:
        msgs = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": b} for i, b in enumerate(bodies + ["Sure. "])
        ]
        text = chat_prompt._render_text(tok, msgs, add_generation_prompt=True, template_kwargs={})
        n = len(tok.encode(text, add_special_tokens=False))
        assert message_boundaries(tok, msgs, n, {}, text) == message_boundaries(tok, msgs, n, {})
    finally:
        tok.chat_template = template
