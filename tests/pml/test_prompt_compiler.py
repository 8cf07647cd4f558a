"""Prompts: parsing to the tree, binding to a compiled schema, and every refusal."""

import pytest

from kvreuse.pml import (
    PMLSemanticError,
    PMLSyntaxError,
    SegmentKind,
    compile_prompt,
    compile_schema,
    parse_prompt,
    parse_schema,
)
from kvreuse.pml.syntax import ModuleRef, Prompt, PromptText, Role
from tests.pml.pml_helpers import SCHEMAS, encode, special


@pytest.fixture(scope="module")
def trip(tokenizer):
    return compile_schema(parse_schema((SCHEMAS / "trip.xml").read_text()), tokenizer, tokenizer_id="smollm2")


def test_prompt_tree():
    prompt = parse_prompt(
        '<prompt schema="trip">\n  <planner nights="3">\n    <sea><fjords/></sea>\n  </planner>\n'
        '  <budget amount="900"/>\n  <user>Where first?</user>\n</prompt>'
    )
    assert prompt == Prompt(
        "trip",
        (
            ModuleRef("planner", (("nights", "3"),), (ModuleRef("sea", (), (ModuleRef("fjords"),)),)),
            ModuleRef("budget", (("amount", "900"),)),
        ),
        (PromptText("Where first?", Role.USER),),
    )
    assert (prompt.refs[0].loc.line, prompt.refs[0].loc.column) == (2, 3)


def test_bare_trailing_text_and_several_turns():
    prompt = parse_prompt(
        '<prompt schema="s"><a/>\n  Why?\n<user>One</user><assistant> Two </assistant><user>Three</user></prompt>'
    )
    assert prompt.tail == (
        PromptText("Why?", None, "\n"),
        PromptText("One", Role.USER),
        PromptText("Two", Role.ASSISTANT),
        PromptText("Three", Role.USER),
    )
    assert parse_prompt('<prompt schema="s">  Just text. </prompt>').tail == (PromptText("Just text."),)


@pytest.mark.parametrize(
    "text, message, line, column",
    [
        ("<prompt/>", "missing the 'schema'", 1, 1),
        ('<schema name="s"/>', "expected <prompt>", 1, 1),
        ('<prompt schema="s" x="1"/>', "unknown attribute", 1, 1),
        ('<prompt schema="s">\n<a>text</a></prompt>', "cannot contain text", 2, 4),
        ('<prompt schema="s">hello <a/></prompt>', "after the prompt text", 1, 26),
        ('<prompt schema="s"><user>x</user>\n  <a/></prompt>', "after the prompt text", 2, 3),
        ('<prompt schema="s"><user><a/></user></prompt>', "may only contain text", 1, 26),
        ('<prompt schema="s"><a><user/></a></prompt>', "inside a module reference", 1, 23),
    ],
)
def test_prompt_syntax_errors(text, message, line, column):
    with pytest.raises(PMLSyntaxError) as info:
        parse_prompt(text)
    assert message in info.value.reason
    assert (info.value.line, info.value.column) == (line, column)


def test_compile_places_arguments_and_user_text(trip, tokenizer):
    prompt = parse_prompt(
        '<prompt schema="trip"><planner nights="3"><rail class="first"/></planner>'
        '<budget amount="900"/><user>Where first?</user></prompt>'
    )
    compiled = compile_prompt(prompt, trip, tokenizer)
    assert compiled.schema_hash == trip.schema_hash
    assert compiled.selected_modules == ("", "planner", "planner/rail", "budget")
    planner, rail, budget = trip.module("planner"), trip.module("planner/rail"), trip.module("budget")
    kinds = [(s.kind, s.label) for s in compiled.segments]
    assert kinds == [
        (SegmentKind.ARGUMENT, "planner:nights"),
        (SegmentKind.ARGUMENT, "planner/rail:class"),
        (SegmentKind.UNCACHED_MODULE, "budget"),
        (SegmentKind.TEXT, "text"),
    ]
    nights = compiled.segments[0]
    assert nights.token_ids == tuple(encode(tokenizer, " 3"))
    slot = planner.slot("nights")
    assert nights.position_ids == tuple(range(slot.start, slot.start + len(nights.token_ids)))
    seat = compiled.segments[1]
    assert seat.token_ids == tuple(encode(tokenizer, " first"))
    assert seat.position_ids[0] == rail.slot("class").start
    # the uncached module is computed per request with its argument in place
    money = compiled.segments[2]
    assert tokenizer.decode(money.token_ids) == "\nBudget: 900 euros."
    assert money.position_ids[0] == budget.start
    text = compiled.segments[3]
    expected = (
        special(tokenizer, "<|im_start|>user\n")
        + encode(tokenizer, "Where first?")
        + special(tokenizer, "<|im_end|>\n<|im_start|>assistant\n")
    )
    assert text.token_ids == tuple(expected)
    assert text.position_ids == tuple(range(trip.length, trip.length + len(expected)))
    assert compiled.next_position == trip.length + len(expected)
    assert list(compiled.new_position_ids) == sorted(compiled.new_position_ids)
    assert len(compiled.new_token_ids) == sum(len(s.token_ids) for s in compiled.segments)


def test_assembled_lists_stored_tokens_of_selected_modules(trip, tokenizer):
    prompt = parse_prompt(
        '<prompt schema="trip"><planner nights="2"><sea><islands/></sea></planner><budget amount=""/></prompt>'
    )
    compiled = compile_prompt(prompt, trip, tokenizer)
    names = [name for name, _, _ in trip.assembled(compiled)]
    assert names == ["planner", "planner/sea", "planner/sea/islands"]  # root is empty, budget uncached
    for name, token_ids, position_ids in trip.assembled(compiled):
        module = trip.module(name)
        assert (token_ids, position_ids) == (module.stored_token_ids, module.stored_position_ids)
        assert not set(position_ids) & module.slot_positions
    # no trailing text: decoding continues right after the highest assembled position
    highest = max(max(p) for _, _, p in trip.assembled(compiled))
    highest = max(highest, *compiled.new_position_ids)
    assert compiled.next_position == highest + 1


def test_generation_prompt_only_after_a_user_turn(trip, tokenizer):
    base = '<prompt schema="trip"><planner nights="1"/><budget amount="1"/>'
    after_user = compile_prompt(parse_prompt(base + "<user>Go</user></prompt>"), trip, tokenizer)
    assert tokenizer.decode(after_user.segments[-1].token_ids).endswith("<|im_start|>assistant\n")
    bare = compile_prompt(parse_prompt(base + "Go</prompt>"), trip, tokenizer)
    assert tokenizer.decode(bare.segments[-1].token_ids) == "Go"
    off = compile_prompt(parse_prompt(base + "<user>Go</user></prompt>"), trip, tokenizer, add_generation_prompt=False)
    assert tokenizer.decode(off.segments[-1].token_ids).endswith("<|im_end|>\n")


def _semantic(trip, tokenizer, text):
    with pytest.raises(PMLSemanticError) as info:
        compile_prompt(parse_prompt(text), trip, tokenizer)
    return info.value


def test_unknown_schema(trip, tokenizer):
    error = _semantic(trip, tokenizer, '<prompt schema="nope">hi</prompt>')
    assert "unknown schema 'nope'" in str(error) and "trip" in str(error)
    assert compile_prompt(
        parse_prompt('<prompt schema="trip"><budget amount="1"/>hi</prompt>'), {"trip": trip}, tokenizer
    )


def test_unknown_module_names_it_with_location(trip, tokenizer):
    error = _semantic(trip, tokenizer, '<prompt schema="trip">\n <planner nights="1"><bus/></planner></prompt>')
    assert error.module == "planner/bus"
    assert (error.line, error.column) == (2, 22)
    error = _semantic(trip, tokenizer, '<prompt schema="trip"><rail/></prompt>')  # nested, not top level
    assert error.module == "rail"


def test_two_members_of_one_union(trip, tokenizer):
    error = _semantic(
        trip, tokenizer, '<prompt schema="trip"><planner nights="1"><rail class="a"/><sea/></planner></prompt>'
    )
    assert error.module == "planner/sea" and "planner/rail" in str(error)


def test_module_selected_twice(trip, tokenizer):
    error = _semantic(trip, tokenizer, '<prompt schema="trip"><budget amount="1"/><budget amount="2"/></prompt>')
    assert error.module == "budget"


def test_missing_argument_names_module_and_parameter(trip, tokenizer):
    error = _semantic(trip, tokenizer, '<prompt schema="trip"><planner/></prompt>')
    assert (error.module, error.parameter) == ("planner", "nights")


def test_unknown_argument(trip, tokenizer):
    error = _semantic(trip, tokenizer, '<prompt schema="trip"><planner nights="1" days="2"/></prompt>')
    assert (error.module, error.parameter) == ("planner", "days")


def test_over_long_argument_names_module_parameter_and_counts(trip, tokenizer):
    error = _semantic(trip, tokenizer, '<prompt schema="trip"><planner nights="one two three four five"/></prompt>')
    assert (error.module, error.parameter) == ("planner", "nights")
    assert "length 4" in str(error)


def test_argument_may_fill_its_slot_exactly_or_be_empty(trip, tokenizer):
    # SmolLM2 splits digits and the lead space is a token of its own: the slot (length 4)
    # reserves 5 positions, so a value of exactly 4 tokens fits, as in the reference.
    assert len(encode(tokenizer, "1234")) == 4 and len(encode(tokenizer, " 1234")) == 5
    slot = trip.module("planner").slot("nights")
    fits = compile_prompt(parse_prompt('<prompt schema="trip"><planner nights="1234"/></prompt>'), trip, tokenizer)
    assert fits.segments[0].token_ids == tuple(encode(tokenizer, " 1234"))
    assert fits.segments[0].position_ids == tuple(range(slot.start, slot.end))
    error = _semantic(trip, tokenizer, '<prompt schema="trip"><planner nights="12345"/></prompt>')
    assert "is 5 tokens" in str(error) and "length 4" in str(error)
    empty = compile_prompt(parse_prompt('<prompt schema="trip"><planner nights=""/></prompt>'), trip, tokenizer)
    assert empty.segments == ()


def test_docs_rag_example_numbers_hold(tokenizer):
    import re
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "pml.md").read_text()
    schema_text, prompt_text = re.findall(r"```xml\n(.*?)```", doc, re.S)[-2:]
    rag = compile_schema(parse_schema(schema_text), tokenizer, tokenizer_id="smollm2")
    assert rag.length == 89
    assert {rag.module(n).start for n in ("rules", "routes", "fees")} == {54}
    assert rag.module("").attends_to == ("rules",)
    assert rag.module("reader").slot("who").start == 77
    prompt = compile_prompt(parse_prompt(prompt_text), rag, tokenizer)
    assert prompt.selected_modules == ("", "tools", "routes", "reader")
    assert prompt.next_position == 107
