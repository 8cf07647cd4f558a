"""``syntax.Schema`` + tokenizer -> ``CompiledSchema`` (token ids and positions).

Position rules (SPEC section 6):
- Items take contiguous offsets in schema order, starting at 0: text takes as many
  positions as it has tokens, role markers likewise, a parameter takes ``length``.
- A nested module occupies its span inside its parent; the parent's own tokens skip it.
- All members of a union start at the union's offset; the union is as long as its
  longest member, and whatever follows it starts after that.
- A module's own tokens attend only to each other during precompute, plus, for a union
  with ``scaffold="m"``, the enclosing module's tokens after that union also see member
  ``m``'s tokens (``attends_to``): ``m`` stands in for whichever member a request picks.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from kvreuse.pml.compiled import ROOT_MODULE, CompiledModule, CompiledSchema, ParameterSlot
from kvreuse.pml.encoder import TextEncoder
from kvreuse.pml.errors import PMLSemanticError
from kvreuse.pml.roles import RoleFormat
from kvreuse.pml.syntax import BodyItem, Module, Parameter, RoleBlock, Schema, Text, Union

HASH_FORMAT_VERSION = 2  # bump when the layout rules change, so persisted KV is not reused


@dataclass
class _Draft:
    """A module being laid out (mutable only inside ``compile_schema``)."""

    qualified_name: str
    name: str
    parent: str | None
    union: int | None
    start: int
    cached: bool
    length: int = 0
    token_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    slots: list[ParameterSlot] = field(default_factory=list)
    attends_to: list[str] = field(default_factory=list)

    def emit(self, token_ids: tuple[int, ...], offset: int) -> int:
        self.token_ids.extend(token_ids)
        self.position_ids.extend(range(offset, offset + len(token_ids)))
        return offset + len(token_ids)

    def freeze(self) -> CompiledModule:
        return CompiledModule(
            qualified_name=self.qualified_name,
            name=self.name,
            parent=self.parent,
            union=self.union,
            start=self.start,
            length=self.length,
            token_ids=tuple(self.token_ids),
            position_ids=tuple(self.position_ids),
            slots=tuple(self.slots),
            attends_to=tuple(self.attends_to),
            cached=self.cached,
        )


class _Layout:
    """Walks the tree once, assigning offsets. One instance per compile."""

    def __init__(self, encoder: TextEncoder, roles: RoleFormat) -> None:
        self._encoder = encoder
        self._roles = roles
        self._placeholder: int | None = None
        self.drafts: list[_Draft] = []  # schema pre-order
        self._unions = 0

    def module(self, draft: _Draft, body: tuple[BodyItem, ...]) -> int:
        self.drafts.append(draft)
        end = self._body(draft, body, draft.start)
        draft.length = end - draft.start
        return end

    def _body(self, draft: _Draft, body: tuple[BodyItem, ...], offset: int) -> int:
        for item in body:
            if isinstance(item, Text):
                offset = draft.emit(self._encoder.text(item.lead + item.text), offset)
            elif isinstance(item, Parameter):
                offset = self._parameter(draft, item, offset)
            elif isinstance(item, RoleBlock):
                markers = self._roles.markers(item.role, module=draft.qualified_name)
                offset = draft.emit(self._encoder.markers(markers.prefix), offset)
                offset = self._body(draft, item.body, offset)
                offset = draft.emit(self._encoder.markers(markers.suffix), offset)
            elif isinstance(item, Module):
                offset = self._child(draft, item, offset, union=None)
            elif isinstance(item, Union):
                offset = self._union(draft, item, offset)
            else:  # pragma: no cover - the syntax tree is closed
                raise TypeError(f"unknown syntax node {item!r}")
        return offset

    def _child(self, parent: _Draft, module: Module, offset: int, *, union: int | None) -> int:
        qualified = f"{parent.qualified_name}/{module.name}" if parent.qualified_name else module.name
        child = _Draft(qualified, module.name, parent.qualified_name, union, offset, module.cache)
        return self.module(child, module.body)

    def _union(self, draft: _Draft, union: Union, offset: int) -> int:
        index = self._unions
        self._unions += 1
        ends = [self._child(draft, member, offset, union=index) for member in union.members]
        if union.scaffold is not None:
            prefix = f"{draft.qualified_name}/" if draft.qualified_name else ""
            draft.attends_to.append(prefix + union.scaffold)
        return max(ends)

    def _parameter(self, draft: _Draft, parameter: Parameter, offset: int) -> int:
        if draft.qualified_name == ROOT_MODULE:  # trees built in code skip the parser's check
            raise PMLSemanticError(f"parameter {parameter.name!r} is outside any module", parameter=parameter.name)
        lead_tokens = len(self._encoder.text(parameter.lead)) if parameter.lead else 0
        size = parameter.length + lead_tokens  # the separator does not eat into the value's length
        scaffold = self._encoder.text(parameter.lead + parameter.scaffold) if parameter.scaffold else ()
        own = len(self._encoder.text(parameter.scaffold)) if parameter.scaffold else 0
        if own > parameter.length or len(scaffold) > size:
            raise PMLSemanticError(
                f"parameter {parameter.name!r} of module {draft.qualified_name!r}: scaffold is "
                f"{own} tokens ({len(scaffold)} with the separator before it), longer than its "
                f"length {parameter.length}: shorten the scaffold or raise length",
                module=draft.qualified_name,
                parameter=parameter.name,
                line=parameter.loc.line or None,
                column=parameter.loc.column or None,
            )
        if self._placeholder is None:
            self._placeholder = self._encoder.placeholder_id()
        filler = (self._placeholder,) * (size - len(scaffold))
        draft.slots.append(
            ParameterSlot(draft.qualified_name, parameter.name, offset, parameter.length, parameter.lead, lead_tokens)
        )
        return draft.emit(scaffold + filler, offset)


def _canonical(node: Any) -> Any:
    """A JSON-able form of a syntax tree without source locations."""
    if isinstance(node, enum.Enum):
        return node.value
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        out = {"type": type(node).__name__}
        for f in dataclasses.fields(node):
            if f.name != "loc":
                out[f.name] = _canonical(getattr(node, f.name))
        return out
    if isinstance(node, (tuple, list)):
        return [_canonical(x) for x in node]
    return node


def schema_hash(schema: Schema, roles: RoleFormat, placeholder_id: int | None, tokenizer_id: str) -> str:
    """sha256 hex over the canonical tree, role markers, placeholder and tokenizer identity."""
    payload = {
        "format": HASH_FORMAT_VERSION,
        "tree": _canonical(schema),
        "roles": _canonical(roles),
        "placeholder": placeholder_id,
        "tokenizer": tokenizer_id,
    }
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def compile_schema(
    schema: Schema,
    tokenizer: Any,
    *,
    tokenizer_id: str,
    roles: RoleFormat | None = None,
) -> CompiledSchema:
    """Tokenise ``schema`` with ``tokenizer`` and lay it out in positions.

    ``tokenizer_id`` names the tokenizer (e.g. the model identity and revision); it goes
    into ``schema_hash``. ``roles`` defaults to ``RoleFormat.from_tokenizer(tokenizer)``.
    Raises ``PMLSemanticError`` when a parameter scaffold is longer than its slot or a
    role tag cannot be rendered by the chat template, ``PMLError`` when the tokenizer has
    no token to fill parameter slots with.
    """
    if not tokenizer_id:
        raise ValueError("tokenizer_id must name the tokenizer")
    encoder = TextEncoder(tokenizer)
    roles = roles if roles is not None else RoleFormat.from_tokenizer(tokenizer)
    layout = _Layout(encoder, roles)
    root = _Draft(ROOT_MODULE, schema.name, None, None, 0, True)
    length = layout.module(root, schema.body)
    modules = tuple(d.freeze() for d in layout.drafts)
    placeholder = encoder.placeholder_id() if any(m.slots for m in modules) else None
    return CompiledSchema(
        name=schema.name,
        schema_hash=schema_hash(schema, roles, placeholder, tokenizer_id),
        tokenizer_id=tokenizer_id,
        length=length,
        modules=modules,
        roles=roles,
        tree=schema,
    )
