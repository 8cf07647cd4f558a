"""Property tests: layout invariants on random schemas, robustness on random markup."""

from hypothesis import HealthCheck, given, settings, strategies as st

from kvreuse.pml import PMLError, compile_prompt, compile_schema, parse_prompt, parse_schema
from kvreuse.pml.syntax import Module, ModuleRef, Parameter, Prompt, PromptText, Schema, Text, Union
from tests.pml.pml_helpers import CharTokenizer

CHARS = CharTokenizer()

_leaf = st.one_of(
    st.text(alphabet="ab \n", min_size=1, max_size=4).map(lambda s: ("text", s)),
    st.integers(1, 4).map(lambda n: ("param", n)),
)
_shape = st.recursive(
    _leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(lambda body: ("module", body)),
        st.lists(st.lists(inner, max_size=3), min_size=1, max_size=3).map(lambda members: ("union", members)),
    ),
    max_leaves=20,
)


def _build(shapes, counter, *, root: bool = False) -> tuple:
    """Shapes -> syntax items with names unique per scope (m0, m1, ...; p0, p1, ...)."""
    items = []
    for kind, value in shapes:
        if kind == "text" or (kind == "param" and root):  # the root may not hold parameters
            items.append(Text(str(value)))
        elif kind == "param":
            items.append(Parameter(f"p{next(counter)}", value))
        elif kind == "module":
            items.append(Module(f"m{next(counter)}", _build(value, counter)))
        else:
            items.append(Union(tuple(Module(f"m{next(counter)}", _build(m, counter)) for m in value)))
    return tuple(items)


def _schema(shapes) -> Schema:
    import itertools

    return Schema("s", _build(shapes, itertools.count(), root=True))


def _refs(body, compiled, scope) -> tuple:
    """Select every module, and the last member of every union, with argument "a"."""
    refs = []
    for item in body:
        modules = [item] if isinstance(item, Module) else [item.members[-1]] if isinstance(item, Union) else []
        for module in modules:
            qualified = f"{scope}/{module.name}" if scope else module.name
            args = tuple((slot.name, "a") for slot in compiled.module(qualified).slots)
            refs.append(ModuleRef(module.name, args, _refs(module.body, compiled, qualified)))
    return tuple(refs)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_shape, max_size=5))
def test_layout_invariants(shapes):
    compiled = compile_schema(_schema(shapes), CHARS, tokenizer_id="chars")
    owner = {}
    for module in compiled.modules:
        assert len(module.token_ids) == len(module.position_ids)
        assert all(0 <= p < compiled.length for p in module.position_ids)
        assert list(module.position_ids) == sorted(set(module.position_ids))
        assert all(module.start <= p < module.start + module.length for p in module.position_ids)
        for p in module.position_ids:
            owner.setdefault(p, []).append(module)
    # two modules share a position only when they sit in different members of one union
    for modules in owner.values():
        for a in modules:
            for b in modules:
                if a is not b:
                    assert (
                        a.union is not None or b.union is not None or _in_union(compiled, a) or _in_union(compiled, b)
                    )
    # members of a union share their start; the union spans its longest member
    by_union = {}
    for module in compiled.modules:
        if module.union is not None:
            by_union.setdefault(module.union, []).append(module)
    for members in by_union.values():
        assert len({m.start for m in members}) == 1

    prompt = Prompt("s", _refs(compiled.tree.body, compiled, ""), (PromptText("q"),))
    bound = compile_prompt(prompt, compiled, CHARS)
    used = [p for _, _, ps in compiled.assembled(bound) for p in ps] + list(bound.new_position_ids)
    assert len(used) == len(set(used))  # one selection never puts two tokens at one position
    assert max(used) + 1 == bound.next_position
    assert bound.new_position_ids[-1] == compiled.length  # the text "q" follows the schema


def _in_union(compiled, module) -> bool:
    while module.parent is not None:
        if module.union is not None:
            return True
        module = compiled.module(module.parent)
    return False


_markup = st.lists(
    st.sampled_from(
        [
            '<schema name="s">',
            "</schema>",
            '<module name="m">',
            '<module name="n">',
            "</module>",
            "<union>",
            "</union>",
            '<param name="p" len="2"/>',
            "<user>",
            "</user>",
            "<system>",
            "</system>",
            "text",
            "&amp;",
            "&bogus;",
            "<!DOCTYPE x>",
            '<prompt schema="s">',
            "</prompt>",
            "<m/>",
            '<m p="1"/>',
            "<",
            ">",
            " ",
            "\n",
        ]
    ),
    max_size=14,
).map("".join)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_markup, st.text(max_size=40)))
def test_parsing_never_raises_anything_but_pml_errors(text):
    for parse in (parse_schema, parse_prompt):
        try:
            parse(text)
        except PMLError:
            pass
