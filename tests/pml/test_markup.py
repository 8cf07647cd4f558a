"""The hardened XML reader: refusals, limits, and error locations."""

import pytest

from kvreuse.pml import MarkupLimits, PMLSyntaxError, parse_prompt, parse_schema
from kvreuse.pml.markup import read_markup


def test_predefined_entities_character_references_and_cdata_are_text():
    root = read_markup('<a>x &lt; y &amp;&#65;<![CDATA[<b>&amp;]]></a>')
    assert root.children[0].text == "x < y &A<b>&amp;"


def test_comments_do_not_split_a_text_run():
    root = read_markup("<a>one <!-- note --> two</a>")
    assert [c.text for c in root.children] == ["one  two"]


@pytest.mark.parametrize(
    "text, what",
    [
        ('<!DOCTYPE schema [<!ENTITY e "boom">]><schema name="s">&e;</schema>', "DOCTYPE"),
        ('<!DOCTYPE schema SYSTEM "file:///etc/passwd"><schema name="s"/>', "DOCTYPE"),
        (
            '<?xml version="1.0"?>\n<!DOCTYPE lolz [\n <!ENTITY lol "lol">\n'
            ' <!ENTITY lol2 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">\n]>\n<lolz>&lol2;</lolz>',
            "DOCTYPE",
        ),
    ],
)
def test_dtds_and_entities_are_refused_with_a_location(text, what):
    with pytest.raises(PMLSyntaxError) as info:
        read_markup(text)
    assert what in str(info.value)
    assert info.value.line >= 1 and info.value.column >= 1


def test_undefined_entity_is_a_syntax_error_with_line_and_column():
    with pytest.raises(PMLSyntaxError) as info:
        parse_schema('<schema name="s">\n  <module name="m">a &nope; b</module>\n</schema>')
    assert (info.value.line, info.value.column) == (2, 22)
    assert "undefined entity" in info.value.reason


def test_malformed_markup_reports_line_and_column():
    with pytest.raises(PMLSyntaxError) as info:
        parse_schema('<schema name="s">\n  <module name="m">text</modul>\n</schema>')
    assert info.value.line == 2
    assert info.value.column == 26  # expat points into the bad closing tag
    assert isinstance(info.value, ValueError)


def test_unclosed_document():
    with pytest.raises(PMLSyntaxError) as info:
        parse_prompt('<prompt schema="s">\n<a>')
    assert info.value.line == 2


def test_depth_limit():
    deep = "<a>" * 5 + "</a>" * 5
    read_markup(deep, MarkupLimits(max_depth=5))
    with pytest.raises(PMLSyntaxError) as info:
        read_markup(deep, MarkupLimits(max_depth=4))
    assert "deeper than 4" in info.value.reason
    assert (info.value.line, info.value.column) == (1, 13)


def test_default_depth_limit_stops_deep_nesting_before_recursion():
    deep = "<a>" * 10_000 + "</a>" * 10_000
    with pytest.raises(PMLSyntaxError):
        read_markup(deep)


def test_size_limit():
    text = '<schema name="s">' + "x" * 100 + "</schema>"
    with pytest.raises(PMLSyntaxError) as info:
        parse_schema(text, limits=MarkupLimits(max_chars=50))
    assert "limit 50" in info.value.reason


def test_element_count_limit():
    text = "<a>" + "<b/>" * 10 + "</a>"
    with pytest.raises(PMLSyntaxError) as info:
        read_markup(text, MarkupLimits(max_elements=5))
    assert "more than 5 elements" in info.value.reason


def test_limits_are_validated_where_built():
    with pytest.raises(ValueError):
        MarkupLimits(max_depth=0)


@pytest.mark.parametrize(
    "body, char, column, fixed",
    [  # prose: "&B" starts an entity reference, which is malformed
        ('  <module name="m">Soul, funk and R&B hits</module>', "&", 36, "R&amp;B"),
    ],
)
def test_bare_ampersand_or_less_than_in_text_says_how_to_escape_it(body, char, column, fixed):
    text = f'<schema name="s">\n{body}\n</schema>'
    with pytest.raises(PMLSyntaxError) as info:
        parse_schema(text)
    escaped = "&amp;" if char == "&" else "&lt;"
    assert f"a bare {char!r} in text: write it as {escaped!r}" in str(info.value)
    assert "CDATA" in str(info.value) and "src=" in str(info.value)
    line = text.split("\n")[info.value.line - 1]
    assert line[info.value.column - 1] == char and info.value.column == column
    # escaped as the hint says, the same text parses and keeps the character
    bare = fixed.replace("&amp;", "&").replace("&lt;", "<")
    assert bare in parse_schema(text.replace(bare, fixed)).body[0].body[0].text


def test_well_formed_errors_get_no_escape_hint():
    for text in (
        '<schema name="s">\n  <module name="m">a &nope; b</module>\n</schema>',
        '<schema name="s">\n  <module name="m">text</modul>\n</schema>',
    ):
        with pytest.raises(PMLSyntaxError) as info:
            parse_schema(text)
        assert "a bare" not in str(info.value)


@pytest.mark.parametrize(
    "literal",
    [
        "if 0 <= i < n: return a && b",
        "x < 3 & y > 2; 1<2; a <= b; c & d; e<=f; 1 &&2; <",
        "pointers: p->q, a < -1, <> and < / >",
    ],
)
def test_bare_less_than_and_ampersand_that_cannot_start_markup_stay_as_written(literal):
    text = f'<schema name="s">\n  <module name="m">\n{literal}\n</module>\n</schema>'
    assert parse_schema(text).body[0].body[0].text.strip() == literal


def test_literals_next_to_markup_cdata_entities_and_positions():
    # entities and CDATA keep their meaning; a real tag after a literal '<' still parses
    text = '<schema name="s"><module name="m">a < b &amp; c &#38; <![CDATA[0 < 1 && 2]]> d</module></schema>'
    assert parse_schema(text).body[0].body[0].text == "a < b & c & 0 < 1 && 2 d"
    # a malformed tag after literals is reported at its own column in the original text
    bad = '<schema name="s">\n<module name="m">é < x && y <bad</module>\n</schema>'
    with pytest.raises(PMLSyntaxError) as info:
        parse_schema(bad)
    assert (info.value.line, info.value.column) == (2, 33)
    assert bad.split("\n")[1][32] == "<"
