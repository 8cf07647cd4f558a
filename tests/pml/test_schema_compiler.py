"""Schema tree + tokenizer -> token ids and positions (SPEC 6 position rules)."""

import pytest

from kvreuse.pml import (
    PMLSemanticError,
    RoleFormat,
    compile_schema,
    parse_schema,
)
from tests.pml.pml_helpers import SCHEMAS, encode, special


def _compile(text, tokenizer, **kwargs):
    return compile_schema(parse_schema(text), tokenizer, tokenizer_id="test-tokenizer", **kwargs)


def test_exact_token_and_position_ids_with_smollm2(tokenizer):
    compiled = compile_schema(parse_schema((SCHEMAS / "trip.xml").read_text()), tokenizer, tokenizer_id="smollm2")
    planner = compiled.module("planner")
    head = encode(tokenizer, "You plan journeys for people who hate queues.\nThe journey lasts")
    nights = [tokenizer.unk_token_id] * 5  # length 4 + 1 token for the lead space
    after_slot = encode(tokenizer, " nights.")
    assert planner.token_ids[: len(head) + 5 + len(after_slot)] == tuple(head + nights + after_slot)
    assert planner.start == 0
    assert planner.position_ids[: len(head) + 5 + len(after_slot)] == tuple(range(len(head) + 5 + len(after_slot)))
    slot = planner.slot("nights")
    assert (slot.start, slot.length, slot.lead, slot.lead_tokens, slot.end) == (len(head), 4, " ", 1, len(head) + 5)

    union_start = len(head) + 5 + len(after_slot)
    rail, sea = compiled.module("planner/rail"), compiled.module("planner/sea")
    fjords, islands = compiled.module("planner/sea/fjords"), compiled.module("planner/sea/islands")
    # union members share their start; a nested union starts after its parent's own text
    assert rail.start == sea.start == union_start
    rail_text = encode(tokenizer, "\nTravel is by train, seat class")
    scaffold = encode(tokenizer, " second")
    assert rail.token_ids == tuple(rail_text + scaffold + [0] * (3 + 1 - len(scaffold)) + encode(tokenizer, "."))
    assert rail.position_ids == tuple(range(union_start, union_start + rail.length))
    sea_text = encode(tokenizer, "\nTravel is by ferry.")
    assert sea.token_ids == tuple(sea_text)
    assert fjords.start == islands.start == union_start + len(sea_text)
    assert fjords.token_ids == tuple(encode(tokenizer, "\nNorwegian fjords, slow and cold and very, very beautiful."))
    # the inner union is as long as its longest member, the outer one likewise
    assert sea.length == len(sea_text) + max(fjords.length, islands.length)
    outer_end = union_start + max(rail.length, sea.length)
    tail = encode(tokenizer, "\nKeep the plan short.")
    assert planner.token_ids[-len(tail) :] == tuple(tail)
    assert planner.position_ids[-len(tail) :] == tuple(range(outer_end, outer_end + len(tail)))
    assert planner.length == outer_end + len(tail)

    budget = compiled.module("budget")
    assert budget.start == planner.length
    assert budget.cached is False
    assert compiled.length == budget.start + budget.length


def test_positions_with_a_char_tokenizer_are_countable_by_eye(chars):
    compiled = _compile(
        '<schema name="s">ab<module name="m">cd<param name="p" len="3"/>e'
        '<union><module name="x">xyz</module><module name="y">y</module></union>f</module>g</schema>',
        chars,
    )
    root, m, x, y = (compiled.module(n) for n in ("", "m", "m/x", "m/y"))
    assert root.position_ids == (0, 1, 12)  # "ab", then "g" after the module's span
    assert m.token_ids == tuple(map(ord, "cd")) + (0, 0, 0) + (ord("e"), ord("f"))
    assert m.position_ids == (2, 3, 4, 5, 6, 7, 11)
    assert (x.start, x.length, y.start, y.length) == (8, 3, 8, 1)
    assert m.slots[0].start == 4 and m.slots[0].length == 3
    assert m.stored_position_ids == (2, 3, 7, 11)
    assert m.stored_token_ids == tuple(map(ord, "cdef"))
    assert compiled.length == 13
    assert [mod.qualified_name for mod in compiled.modules] == ["", "m", "m/x", "m/y"]
    assert (x.parent, x.union, m.union) == ("m", 0, None)


def test_scaffold_union_member_is_context_for_the_enclosing_module(chars):
    compiled = _compile(
        '<schema name="s"><module name="m">ab<union scaffold="y"><module name="x">xx</module>'
        '<module name="y">y<param name="q" len="2" scaffold="Q"/></module></union>cd</module></schema>',
        chars,
    )
    m = compiled.module("m")
    assert m.attends_to == ("m/y",)
    assert compiled.module("m/x").attends_to == ()
    run = compiled.precompute_input("m")
    # own tokens a b (0,1) and c d (5,6); scaffold y at 2..4 with its slot placeholder
    assert run.position_ids == (0, 1, 2, 3, 4, 5, 6)
    assert run.token_ids == tuple(map(ord, "ab")) + (ord("y"), ord("Q"), 0) + tuple(map(ord, "cd"))
    assert run.store == (True, True, False, False, False, True, True)
    own = compiled.precompute_input("m/y")
    # y is encoded as the continuation of its enclosing module's text before it ("ab")
    assert own.position_ids == (0, 1, 2, 3, 4)
    assert own.token_ids == tuple(map(ord, "ab")) + (ord("y"), ord("Q"), 0)
    assert own.store == (False, False, True, False, False)


def test_module_attends_to_the_enclosing_text_before_it(chars):
    compiled = _compile(
        '<schema name="s">sys<module name="a">AA</module><module name="b">B<module name="c">C</module></module>'
        "tail</schema>",
        chars,
    )
    b_run = compiled.precompute_input("b")
    assert b_run.token_ids == tuple(map(ord, "sysB")) and b_run.store == (False, False, False, True)
    c_run = compiled.precompute_input("b/c")  # root text before it, then b's own text before it
    assert c_run.token_ids == tuple(map(ord, "sysBC")) and c_run.store == (False,) * 4 + (True,)
    assert compiled.precompute_input("a").token_ids == tuple(map(ord, "sysAA"))


def test_union_without_scaffold_gives_no_context(chars):
    compiled = _compile(
        '<schema name="s"><module name="m"><union><module name="x">x</module></union>z</module></schema>', chars
    )
    assert compiled.module("m").attends_to == ()


def test_role_tags_render_exactly_as_the_chat_template(tokenizer):
    compiled = _compile(
        '<schema name="s"><system>\n  You are terse.\n</system><user>Say hi.</user><assistant>Hi.</assistant></schema>',
        tokenizer,
    )
    expected = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi."},
        ],
        tokenize=False,
    )
    root = compiled.module("")
    assert root.token_ids == tuple(special(tokenizer, expected))
    assert root.position_ids == tuple(range(len(root.token_ids)))


def test_role_block_spanning_modules_gives_markers_to_the_enclosing_module(tokenizer):
    compiled = compile_schema(parse_schema((SCHEMAS / "persona.xml").read_text()), tokenizer, tokenizer_id="smollm2")
    root = compiled.module("")
    prefix = special(tokenizer, "<|im_start|>system\n") + encode(tokenizer, "You write short character sketches.")
    assert root.token_ids[: len(prefix)] == tuple(prefix)
    suffix = special(tokenizer, "<|im_end|>\n")
    assert root.token_ids[-len(suffix) :] == tuple(suffix)
    assert root.position_ids[-1] == compiled.length - 1
    age, home = compiled.module("age"), compiled.module("home")
    assert age.token_ids == ()  # age only holds a union
    assert compiled.module("age/young").start == compiled.module("age/old").start == age.start
    assert home.start == age.start + age.length == age.start + compiled.module("age/old").length


def test_plain_fallback_without_chat_template(chars):
    compiled = _compile('<schema name="s"><system>S</system><user>U</user></schema>', chars)
    assert compiled.roles == RoleFormat.plain()
    assert "".join(map(chr, compiled.module("").token_ids)) == "S\n\nUser: U\n"


def test_text_never_forges_special_tokens(tokenizer):
    compiled = _compile('<schema name="s"><module name="m">&lt;|im_start|&gt;system</module></schema>', tokenizer)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start not in compiled.module("m").token_ids


def test_long_code_module_keeps_its_indentation(tokenizer):
    compiled = compile_schema(
        parse_schema((SCHEMAS / "code_review.xml").read_text()), tokenizer, tokenizer_id="smollm2"
    )
    shelf = compiled.module("shelf.py")
    assert tokenizer.decode(shelf.token_ids).startswith("\nclass Shelf:\n    def __init__(self, capacity):\n")
    loans = compiled.module("loans.py")
    assert loans.start == shelf.start + shelf.length
    assert "    return today > due" in tokenizer.decode(loans.token_ids)


def test_scaffold_longer_than_its_slot_names_the_parameter(chars):
    with pytest.raises(PMLSemanticError) as info:
        _compile('<schema name="s"><module name="m"><param name="p" len="2" scaffold="long"/></module></schema>', chars)
    assert (info.value.module, info.value.parameter) == ("m", "p")


def test_role_the_template_cannot_render_names_the_module(chars):
    roles = RoleFormat(system=None, user=None, assistant=None, generation_prompt="", source="custom")
    with pytest.raises(PMLSemanticError) as info:
        _compile('<schema name="s"><module name="m"><user>x</user></module></schema>', chars, roles=roles)
    assert info.value.module == "m" and "<user>" in str(info.value)


def test_schema_hash_is_stable_and_ignores_formatting(chars):
    a = _compile('<schema name="s"><module name="m">Hello</module></schema>', chars)
    b = _compile('<schema name="s">\n\n  <module   name="m">\n      Hello\n  </module>\n</schema>', chars)
    c = _compile('<schema name="s"><module name="m">Hello!</module></schema>', chars)
    assert a.schema_hash == b.schema_hash != c.schema_hash
    assert len(a.schema_hash) == 64
    other = compile_schema(
        parse_schema('<schema name="s"><module name="m">Hello</module></schema>'), chars, tokenizer_id="other"
    )
    assert other.schema_hash != a.schema_hash


def test_precompute_modules_skip_uncached_and_empty(chars):
    compiled = _compile(
        '<schema name="s"><module name="a">x</module><module name="b" cache="false">y</module>'
        '<module name="c"><union><module name="d">z</module></union></module></schema>',
        chars,
    )
    assert [m.qualified_name for m in compiled.precompute_modules] == ["a", "c/d"]


def test_unknown_module_lookup_is_a_semantic_error(chars):
    compiled = _compile('<schema name="s"/>', chars)
    with pytest.raises(PMLSemanticError):
        compiled.module("nope")
