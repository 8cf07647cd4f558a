"""Markup tree -> ``syntax.Schema``. No tokenizer: this step only checks structure.

Grammar (attributes in brackets are optional)::

    schema    := <schema name> body </schema>
    body      := (text | module | union | parameter | param | role)*
    module    := <module name [src] [cache="true|false"]> body </module>
               | <module name src [cache]/>            (text read from src_dir/src)
    union     := <union [scaffold=member-name]> module+ </union>
    parameter := <parameter name length [scaffold]/>
    param     := <param name len [scaffold]/>           (short form)
    role      := <system> body </system> | <user> ... | <assistant> ...

Role tags do not nest; parameters are not allowed directly in the schema root (only
inside modules); module names are unique among the modules and union members of one
parent; parameter names are unique within the module that owns them (role tags do not
open a scope).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvreuse.pml import text as ws
from kvreuse.pml.errors import PMLSemanticError, PMLSyntaxError
from kvreuse.pml.markup import CharData, Element, MarkupLimits, read_markup
from kvreuse.pml.syntax import (
    BodyItem,
    Module,
    Parameter,
    Role,
    RoleBlock,
    Schema,
    SourceLocation,
    Text,
    Union,
)

NAME_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")
RESERVED_NAMES = frozenset({"schema", "prompt", "module", "union", "parameter", "param"}) | {
    role.value for role in Role
}
DEFAULT_MAX_PARAMETER_LENGTH = 8192


def _loc(node: Element | CharData) -> SourceLocation:
    return SourceLocation(node.line, node.column)


def _syntax(node: Element | CharData, message: str) -> PMLSyntaxError:
    return PMLSyntaxError(message, node.line, node.column)


@dataclass
class _Scope:
    """Names already used in one module (mutable while that module is being parsed)."""

    qualified: str  # "" for the schema root
    modules: set[str] = field(default_factory=set)
    parameters: set[str] = field(default_factory=set)

    def child(self, name: str) -> str:
        return f"{self.qualified}/{name}" if self.qualified else name


def _check_attrs(element: Element, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    for key, _ in element.attrs:
        if key not in required and key not in optional:
            allowed = ", ".join(required + optional) or "none"
            raise _syntax(element, f"<{element.tag}> has unknown attribute {key!r} (allowed: {allowed})")
    for key in required:
        if element.attr(key) is None:
            raise _syntax(element, f"<{element.tag}> is missing the {key!r} attribute")


def _check_name(element: Element, name: str, what: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        raise _syntax(element, f"{what} name {name!r} is not a valid name")
    if name in RESERVED_NAMES:
        raise _syntax(element, f"{what} name {name!r} is reserved")


class _SchemaReader:
    """Turns one schema element tree into syntax nodes. One instance per document."""

    def __init__(self, src_dir: Path | None, limits: MarkupLimits, max_parameter_length: int) -> None:
        self._src_dir = src_dir
        self._limits = limits
        self._max_parameter_length = max_parameter_length

    def schema(self, root: Element) -> Schema:
        if root.tag != "schema":
            raise _syntax(root, f"expected <schema> as the root element, found <{root.tag}>")
        _check_attrs(root, ("name",), ())
        name = root.attr("name") or ""
        _check_name(root, name, "schema")
        body = self._body(root, _Scope(""), lead="", role=None)
        return Schema(name, body, _loc(root))

    def _body(self, element: Element, scope: _Scope, *, lead: str, role: Role | None) -> tuple[BodyItem, ...]:
        items: list[BodyItem] = []
        forced_lead: str | None = lead  # the next item's lead when it is fixed by rule 3
        pending = ""  # whitespace seen since the previous item
        for child in element.children:
            if isinstance(child, CharData):
                content = ws.normalise(child.text)
                if not content:
                    pending += child.text
                    continue
                sep = ws.separator(pending + ws.leading_whitespace(child.text))
                items.append(Text(content, sep if forced_lead is None else forced_lead, _loc(child)))
                pending, forced_lead = ws.trailing_whitespace(child.text), None
                continue
            item_lead = ws.separator(pending) if forced_lead is None else forced_lead
            item = self._element(child, scope, lead=item_lead, role=role)
            items.append(item)
            pending = ""
            forced_lead = "" if isinstance(item, RoleBlock) else None
        return tuple(items)

    def _element(self, element: Element, scope: _Scope, *, lead: str, role: Role | None) -> BodyItem:
        tag = element.tag
        if tag == "module":
            return self._module(element, scope, lead=lead, role=role)
        if tag == "union":
            return self._union(element, scope, lead=lead, role=role)
        if tag in ("parameter", "param"):
            return self._parameter(element, scope, lead=lead)
        if tag in {r.value for r in Role}:
            if role is not None:
                raise _syntax(element, f"<{tag}> cannot be nested inside <{role.value}>")
            _check_attrs(element, (), ())
            new_role = Role(tag)
            return RoleBlock(new_role, self._body(element, scope, lead="", role=new_role), _loc(element))
        raise _syntax(
            element,
            f"unknown element <{tag}> (allowed: module, union, parameter, param, system, user, assistant)",
        )

    def _module(self, element: Element, scope: _Scope, *, lead: str, role: Role | None) -> Module:
        _check_attrs(element, ("name",), ("src", "cache"))
        name = element.attr("name") or ""
        _check_name(element, name, "module")
        qualified = scope.child(name)
        if name in scope.modules:
            raise PMLSemanticError(
                f"module {qualified!r} is defined twice", module=qualified, line=element.line, column=element.column
            )
        scope.modules.add(name)
        cache_attr = element.attr("cache")
        if cache_attr not in (None, "true", "false"):
            raise _syntax(element, f"module {qualified!r}: cache must be \"true\" or \"false\", not {cache_attr!r}")
        src = element.attr("src")
        if src is not None:
            body = self._source_body(element, qualified, src, lead)
        else:
            body = self._body(element, _Scope(qualified), lead=lead, role=role)
        return Module(name, body, cache_attr != "false", _loc(element))

    def _union(self, element: Element, scope: _Scope, *, lead: str, role: Role | None) -> Union:
        _check_attrs(element, (), ("scaffold",))
        members: list[Module] = []
        for child in element.children:
            if isinstance(child, CharData):
                if child.text.strip():
                    raise _syntax(child, "a <union> may only contain <module> elements, not text")
                continue
            if child.tag != "module":
                raise _syntax(child, f"a <union> may only contain <module> elements, not <{child.tag}>")
            members.append(self._module(child, scope, lead=lead, role=role))
        if not members:
            raise _syntax(element, "a <union> needs at least one <module>")
        scaffold = element.attr("scaffold")
        if scaffold is not None and scaffold not in {m.name for m in members}:
            raise PMLSemanticError(
                f"union scaffold {scope.child(scaffold)!r} is not a member of the union",
                module=scope.child(scaffold),
                line=element.line,
                column=element.column,
            )
        return Union(tuple(members), scaffold, _loc(element))

    def _parameter(self, element: Element, scope: _Scope, *, lead: str) -> Parameter:
        length_attr = "length" if element.tag == "parameter" else "len"
        _check_attrs(element, ("name", length_attr), ("scaffold",))
        if element.children:
            raise _syntax(element, f"<{element.tag}> must be empty")
        name = element.attr("name") or ""
        _check_name(element, name, "parameter")
        if not scope.qualified:
            raise PMLSemanticError(
                f"parameter {name!r} is outside any module; parameters belong in a <module>",
                parameter=name,
                line=element.line,
                column=element.column,
            )
        raw_length = element.attr(length_attr) or ""
        if not re.fullmatch(r"\s*[0-9]+\s*", raw_length):  # ASCII digits only: "²".isdigit() is True
            raise _syntax(element, f"parameter {name!r}: {length_attr} must be a positive integer, not {raw_length!r}")
        length = int(raw_length)
        if not 1 <= length <= self._max_parameter_length:
            raise _syntax(
                element, f"parameter {name!r}: {length_attr} must be between 1 and {self._max_parameter_length}"
            )
        if name in scope.parameters:
            raise PMLSemanticError(
                f"parameter {name!r} is defined twice in module {scope.qualified!r}",
                module=scope.qualified,
                parameter=name,
                line=element.line,
                column=element.column,
            )
        scope.parameters.add(name)
        return Parameter(name, length, element.attr("scaffold"), lead, _loc(element))

    def _source_body(self, element: Element, qualified: str, src: str, lead: str) -> tuple[BodyItem, ...]:
        """Read a module's text from ``src_dir/src``; the file is plain text, never markup."""

        def refuse(reason: str) -> PMLSemanticError:
            return PMLSemanticError(
                f"module {qualified!r}: src {src!r} {reason}",
                module=qualified,
                line=element.line,
                column=element.column,
            )

        if any(isinstance(c, Element) or c.text.strip() for c in element.children):
            raise refuse("is given, so the module must have no content of its own")
        if self._src_dir is None:
            raise refuse("cannot be read: no src_dir is configured (kvreuse serve --schema-src-dir DIR)")
        relative = Path(src)
        if not src or relative.is_absolute() or src.startswith(("/", "\\")) or ".." in relative.parts:
            raise refuse("must be a relative path inside src_dir without '..'")
        root = self._src_dir.resolve()
        path = (root / relative).resolve()
        if not path.is_relative_to(root):
            raise refuse("resolves outside src_dir")
        if not path.is_file():
            raise refuse("is not a file in src_dir")
        if path.stat().st_size > self._limits.max_chars * 4:
            raise refuse(f"is larger than the limit of {self._limits.max_chars} characters")
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise refuse(f"cannot be read as UTF-8 text ({exc.__class__.__name__})") from None
        if len(content) > self._limits.max_chars:
            raise refuse(f"is larger than the limit of {self._limits.max_chars} characters")
        normalised = ws.normalise(content, whole_file=True)
        return (Text(normalised, lead, _loc(element)),) if normalised else ()


def parse_schema(
    text: str,
    *,
    src_dir: str | os.PathLike[str] | None = None,
    limits: MarkupLimits = MarkupLimits(),
    max_parameter_length: int = DEFAULT_MAX_PARAMETER_LENGTH,
) -> Schema:
    """Parse PML schema text into a ``Schema`` tree.

    ``src_dir`` is the only folder ``<module src>`` files are read from; without it any
    ``src`` attribute is refused. Raises ``PMLSyntaxError`` for bad markup and
    ``PMLSemanticError`` for duplicate names, a union scaffold that is not a member, a
    parameter outside a module, or a refused/unreadable ``src``.
    """
    reader = _SchemaReader(Path(src_dir) if src_dir is not None else None, limits, max_parameter_length)
    return reader.schema(read_markup(text, limits))
