"""Schema text -> syntax tree: shapes, the whitespace rule, every refusal."""

import os

import pytest

from kvreuse.pml import PMLSemanticError, PMLSyntaxError, parse_schema
from kvreuse.pml.syntax import Module, Parameter, Role, RoleBlock, Schema, Text, Union
from tests.pml.pml_helpers import SCHEMAS


def test_tree_of_a_small_schema():
    schema = parse_schema(
        """<schema name="s">
            <system>Be brief.</system>
            <module name="m">
                Plan for <param name="days" len="4"/> days.
                <union scaffold="a">
                    <module name="a">Alpha.</module>
                    <module name="b">Beta.</module>
                </union>
            </module>
        </schema>"""
    )
    assert schema == Schema(
        "s",
        (
            RoleBlock(Role.SYSTEM, (Text("Be brief."),)),
            Module(
                "m",
                (
                    Text("Plan for", ""),
                    Parameter("days", 4, None, " "),
                    Text("days.", " "),
                    Union((Module("a", (Text("Alpha.", "\n"),)), Module("b", (Text("Beta.", "\n"),))), "a"),
                ),
            ),
        ),
    )


def test_locations_point_at_elements():
    schema = parse_schema('<schema name="s">\n  <module name="m">x</module>\n</schema>')
    assert (schema.body[0].loc.line, schema.body[0].loc.column) == (2, 3)


def test_whitespace_rule_dedents_code_and_keeps_relative_indentation():
    schema = parse_schema((SCHEMAS / "code_review.xml").read_text())
    user = schema.body[1]
    assert isinstance(user, RoleBlock) and user.role is Role.USER
    shelf = user.body[1]
    assert isinstance(shelf, Module) and shelf.name == "shelf.py"
    text = shelf.body[0]
    assert text.lead == "\n"
    assert text.text.startswith("class Shelf:\n    def __init__(self, capacity):\n        self.capacity")
    assert "if len(self.items) >= self.capacity:" in text.text
    assert text.text.endswith('self.items.append(item)')
    loans = user.body[2]
    assert loans.body[0].text.startswith("from datetime import date, timedelta\n\ndef due_date")
    assert "    return today > due" in loans.body[0].text


def test_first_line_on_the_tag_line_and_indented_rest():
    schema = parse_schema(
        '<schema name="s"><module name="m">First line\n      second\n        third\n   </module></schema>'
    )
    assert schema.body[0].body == (Text("First line\nsecond\n  third"),)


def test_role_contents_and_items_after_role_blocks_have_no_lead():
    schema = parse_schema('<schema name="s"><system>\n  A\n</system>\n\n  after <user>  B </user></schema>')
    assert schema.body == (
        RoleBlock(Role.SYSTEM, (Text("A"),)),
        Text("after", ""),
        RoleBlock(Role.USER, (Text("B"),)),
    )


def test_module_passes_its_lead_to_its_first_item_and_union_to_each_member():
    schema = parse_schema(
        '<schema name="s"><module name="p">Intro.\n  <module name="c">child</module> tail'
        '<union> <module name="x">X</module><module name="y"><param name="q" len="2"/></module></union>'
        "</module></schema>"
    )
    p = schema.body[0]
    assert p.body[1] == Module("c", (Text("child", "\n"),))
    assert p.body[2] == Text("tail", " ")
    union = p.body[3]
    assert union.members[0].body == (Text("X", ""),)
    assert union.members[1].body == (Parameter("q", 2, None, ""),)


def test_every_reference_construct_parses():
    for name in ("code_review.xml", "trip.xml", "persona.xml"):
        schema = parse_schema((SCHEMAS / name).read_text())
        assert schema.name == name.removesuffix(".xml").replace("_", "-")


def test_cache_false_and_both_parameter_forms():
    schema = parse_schema((SCHEMAS / "trip.xml").read_text())
    planner, budget = schema.body
    assert budget.cache is False and planner.cache is True
    rail = planner.body[3].members[0]
    assert rail.body[1] == Parameter("class", 3, "second", " ")


def _syntax(text, **kwargs):
    with pytest.raises(PMLSyntaxError) as info:
        parse_schema(text, **kwargs)
    return info.value


def _semantic(text, **kwargs):
    with pytest.raises(PMLSemanticError) as info:
        parse_schema(text, **kwargs)
    return info.value


@pytest.mark.parametrize(
    "text, message, line, column",
    [
        ('<prompt schema="s"/>', "expected <schema>", 1, 1),
        ("<schema/>", "missing the 'name'", 1, 1),
        ('<schema name="s" x="1"/>', "unknown attribute 'x'", 1, 1),
        ('<schema name="s">\n <b>bold</b></schema>', "unknown element <b>", 2, 2),
        ('<schema name="s"><module>x</module></schema>', "missing the 'name'", 1, 18),
        ('<schema name="s"><module name="9x"/></schema>', "not a valid name", 1, 18),
        ('<schema name="s"><module name="user"/></schema>', "reserved", 1, 18),
        ('<schema name="s"><module name="m"><param name="p"/></module></schema>', "missing the 'len'", 1, 35),
        (
            '<schema name="s"><module name="m"><parameter name="p" len="2"/></module></schema>',
            "unknown attribute 'len'",
            1,
            35,
        ),
        ('<schema name="s"><module name="m"><param name="p" len="two"/></module></schema>', "positive integer", 1, 35),
        ('<schema name="s"><module name="m"><param name="p" len="0"/></module></schema>', "between 1 and", 1, 35),
        ('<schema name="s"><module name="m" cache="no"/></schema>', "cache must be", 1, 18),
        ('<schema name="s"><union>text<module name="a"/></union></schema>', "only contain <module>", 1, 25),
        ('<schema name="s"><union><param name="a" len="1"/></union></schema>', "only contain <module>", 1, 25),
        ('<schema name="s"><union> </union></schema>', "at least one", 1, 18),
        ('<schema name="s"><user><system>x</system></user></schema>', "cannot be nested", 1, 24),
        ('<schema name="s"><user><module name="m"><user/></module></user></schema>', "cannot be nested", 1, 41),
        ('<schema name="s"><system a="1"/></schema>', "unknown attribute", 1, 18),
    ],
)
def test_syntax_errors_carry_line_and_column(text, message, line, column):
    error = _syntax(text)
    assert message in error.reason
    assert (error.line, error.column) == (line, column)


def test_duplicate_module_names_in_one_scope_name_the_module():
    error = _semantic(
        '<schema name="s"><module name="p"><module name="a"/><union><module name="a"/></union></module></schema>'
    )
    assert error.module == "p/a"
    assert "defined twice" in str(error)
    assert error.line == 1


def test_same_module_name_in_different_scopes_is_fine():
    parse_schema(
        '<schema name="s"><module name="a"><module name="x"/></module>'
        '<module name="b"><module name="x"/></module></schema>'
    )


def test_duplicate_parameters_name_module_and_parameter():
    error = _semantic(
        '<schema name="s"><module name="m"><param name="p" len="1"/>'
        '<user><param name="p" len="2"/></user></module></schema>'
    )
    assert (error.module, error.parameter) == ("m", "p")


def test_parameter_outside_modules_is_refused():
    error = _semantic('<schema name="s"><user><param name="p" len="1"/></user></schema>')
    assert error.parameter == "p"


def test_union_scaffold_must_name_a_member():
    error = _semantic(
        '<schema name="s"><module name="m"><union scaffold="z"><module name="a"/></union></module></schema>'
    )
    assert error.module == "m/z"


class TestSrc:
    def test_reads_plain_text_from_src_dir(self, tmp_path):
        (tmp_path / "lib").mkdir()
        (tmp_path / "lib" / "a.py").write_text("def f():\n    return 1 < 2 & 3\n")
        schema = parse_schema('<schema name="s"><module name="a" src="lib/a.py"/></schema>', src_dir=tmp_path)
        assert schema.body[0].body == (Text("def f():\n    return 1 < 2 & 3"),)

    @pytest.mark.parametrize(
        "src, reason",
        [
            ("/etc/passwd", "relative path"),
            ("../x.py", "relative path"),
            ("lib/../../x", "relative path"),
            ("", "relative path"),
            ("missing.py", "not a file"),
        ],
    )
    def test_refused_paths_name_the_module(self, tmp_path, src, reason):
        error = _semantic(f'<schema name="s"><module name="m" src="{src}"/></schema>', src_dir=tmp_path)
        assert error.module == "m" and reason in str(error)

    def test_without_src_dir_src_is_refused(self):
        error = _semantic('<schema name="s"><module name="m" src="a.py"/></schema>')
        assert "no src_dir" in str(error) and error.module == "m"

    def test_symlink_out_of_src_dir_is_refused(self, tmp_path):
        outside = tmp_path / "secret.txt"
        outside.write_text("secret")
        inside = tmp_path / "docs"
        inside.mkdir()
        os.symlink(outside, inside / "link.txt")
        error = _semantic('<schema name="s"><module name="m" src="link.txt"/></schema>', src_dir=inside)
        assert "outside src_dir" in str(error)

    def test_src_and_inline_content_conflict(self, tmp_path):
        (tmp_path / "a.txt").write_text("x")
        error = _semantic('<schema name="s"><module name="m" src="a.txt">inline</module></schema>', src_dir=tmp_path)
        assert "no content of its own" in str(error)


def test_parameter_length_takes_ascii_digits_only():
    with pytest.raises(PMLSyntaxError) as info:
        parse_schema('<schema name="s"><module name="m">a <param name="n" len="\u00b2"/></module></schema>')
    assert "positive integer" in str(info.value) and (info.value.line, info.value.column) == (1, 37)
