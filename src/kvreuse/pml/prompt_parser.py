"""Markup tree -> ``syntax.Prompt``. No tokenizer and no schema needed.

Grammar::

    prompt := <prompt schema="name"> ref* tail* </prompt>
    ref    := <module-name [arg="value"]*> ref* </module-name>   (no text inside)
    tail   := text | <system>text</system> | <user>text</user> | <assistant>text</assistant>

Module references come first; once trailing text or a role tag has started, no more
references may follow. Whitespace follows ``kvreuse.pml.text``: role contents have no
lead, bare text after references keeps one separator.
"""

from __future__ import annotations

from kvreuse.pml import text as ws
from kvreuse.pml.errors import PMLSyntaxError
from kvreuse.pml.markup import CharData, Element, MarkupLimits, read_markup
from kvreuse.pml.syntax import ModuleRef, Prompt, PromptText, Role, SourceLocation

_ROLE_TAGS = {role.value: role for role in Role}


def _loc(node: Element | CharData) -> SourceLocation:
    return SourceLocation(node.line, node.column)


def _ref(element: Element) -> ModuleRef:
    if element.tag in _ROLE_TAGS:
        raise PMLSyntaxError(f"<{element.tag}> cannot appear inside a module reference", element.line, element.column)
    children: list[ModuleRef] = []
    for child in element.children:
        if isinstance(child, CharData):
            if child.text.strip():
                raise PMLSyntaxError(f"module reference <{element.tag}> cannot contain text", child.line, child.column)
            continue
        children.append(_ref(child))
    args = tuple((key, value.strip()) for key, value in element.attrs)
    return ModuleRef(element.tag, args, tuple(children), _loc(element))


def _role_text(element: Element) -> PromptText:
    if element.attrs:
        raise PMLSyntaxError(f"<{element.tag}> takes no attributes", element.line, element.column)
    for child in element.children:
        if isinstance(child, Element):
            raise PMLSyntaxError(
                f"<{element.tag}> in a prompt may only contain text, not <{child.tag}>", child.line, child.column
            )
    raw = "".join(c.text for c in element.children if isinstance(c, CharData))
    return PromptText(ws.normalise(raw), _ROLE_TAGS[element.tag], "", _loc(element))


def parse_prompt(text: str, *, limits: MarkupLimits = MarkupLimits()) -> Prompt:
    """Parse PML prompt text into a ``Prompt`` tree.

    Raises ``PMLSyntaxError`` (line, column) for bad markup, a missing ``schema``
    attribute, text inside a module reference, or a module reference after the trailing
    text has started.
    """
    root = read_markup(text, limits)
    if root.tag != "prompt":
        raise PMLSyntaxError(f"expected <prompt> as the root element, found <{root.tag}>", root.line, root.column)
    for key, _ in root.attrs:
        if key != "schema":
            raise PMLSyntaxError(f"<prompt> has unknown attribute {key!r}", root.line, root.column)
    schema = root.attr("schema")
    if not schema:
        raise PMLSyntaxError("<prompt> is missing the 'schema' attribute", root.line, root.column)

    refs: list[ModuleRef] = []
    tail: list[PromptText] = []
    pending = ""
    first = True  # next tail piece is the first item, or follows a role block: no lead
    for child in root.children:
        if isinstance(child, CharData):
            content = ws.normalise(child.text)
            if not content:
                pending += child.text
                continue
            lead = "" if first else ws.separator(pending + ws.leading_whitespace(child.text))
            tail.append(PromptText(content, None, lead, _loc(child)))
            pending, first = ws.trailing_whitespace(child.text), False
        elif child.tag in _ROLE_TAGS:
            tail.append(_role_text(child))
            pending, first = "", True
        else:
            if tail:
                raise PMLSyntaxError(
                    f"module reference <{child.tag}> after the prompt text; references come first",
                    child.line,
                    child.column,
                )
            refs.append(_ref(child))
            pending, first = "", False
    return Prompt(schema, tuple(refs), tuple(tail), _loc(root))
