"""Markup as third-party schemas write it (tests/pml/schemas/desk.xml): an XML declaration
and comments around the root, tabs, single-quoted and spaced attributes, character
references, an empty role block, a union inside a role block, a parameter inside a module
inside a role block, text between role blocks, and a module in an assistant turn."""

from kvreuse.pml import compile_prompt, compile_schema, parse_prompt, parse_schema
from tests.pml.pml_helpers import SCHEMAS, encode


def _desk(tokenizer):
    return compile_schema(parse_schema((SCHEMAS / "desk.xml").read_text()), tokenizer, tokenizer_id="smollm2")


def test_desk_schema_compiles_with_exact_layout(tokenizer):
    desk = _desk(tokenizer)
    names = [m.qualified_name for m in desk.modules]
    assert names == ["", "calm", "brisk", "ticket", "ticket/brakes", "ticket/gears", "greeting"]
    calm, brisk, ticket = desk.module("calm"), desk.module("brisk"), desk.module("ticket")
    # members share their start; each hands the line break before the union to its text
    assert calm.start == brisk.start and calm.token_ids == tuple(encode(tokenizer, "\nStay calm and polite."))
    assert desk.module("").attends_to == ("calm",)  # the system turn's scaffold
    # the character reference and the escaped ampersand are plain text
    assert "coöperative" in tokenizer.decode(list(desk.module("").token_ids))
    assert desk.module("ticket/gears").token_ids == tuple(encode(tokenizer, "\nGears slip under load & skip teeth."))
    slot = ticket.slot("customer")
    assert (slot.length, slot.lead, slot.lead_tokens) == (6, " ", 1)
    assert ticket.token_ids[: slot.start - ticket.start] == tuple(encode(tokenizer, "Ticket from"))
    # every module's positions lie in its own span, ascending
    for module in desk.modules:
        assert list(module.position_ids) == sorted(set(module.position_ids))
        assert module.start <= module.position_ids[0] and module.position_ids[-1] < module.start + module.length


def test_desk_prompt_assembles_members_and_an_argument_of_exactly_its_length(tokenizer):
    desk = _desk(tokenizer)
    name = "Ana Lucia Souza"
    assert len(encode(tokenizer, name)) == 6  # exactly the parameter's length (5 after the lead space)
    prompt = compile_prompt(
        parse_prompt(
            '<prompt schema="desk">\n\t<brisk/>\n\t<ticket customer="Ana Lucia Souza"><gears/></ticket>\n'
            "\t<user>My chain jumps too.</user>\n</prompt>"
        ),
        desk,
        tokenizer,
    )
    assert prompt.selected_modules == ("", "brisk", "ticket", "ticket/gears")
    argument, *rest = prompt.segments
    slot = desk.module("ticket").slot("customer")
    assert argument.token_ids == tuple(encode(tokenizer, " " + name))
    assert argument.position_ids == tuple(range(slot.start, slot.start + len(argument.token_ids)))
    text = rest[-1]
    assert text.position_ids[0] == desk.length
    assert "My chain jumps too." in tokenizer.decode(list(text.token_ids))
    assert prompt.next_position == text.position_ids[-1] + 1
