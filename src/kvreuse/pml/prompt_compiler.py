"""``syntax.Prompt`` + ``CompiledSchema`` -> ``CompiledPrompt``.

Binding rules:
- The schema root is always selected. A reference ``<name/>`` at the top of the prompt
  selects the root's module or union member ``name``; references nested inside it select
  that module's own modules and union members, and so on. Unreferenced modules (nested
  or not) are left out.
- At most one member of a union may be selected, and no module twice.
- A reference's attributes are the arguments of that module's parameters: every
  parameter of a selected module needs one (``arg=""`` leaves the slot empty), no
  unknown names, and at most the slot's ``length`` tokens (the value's own; ``lead + value``
  tokenised together fills the slot, whose ``size`` also reserves the lead's tokens, see
  ``kvreuse.pml.text``). Arguments take their slot's first positions.
- The trailing text starts at ``schema.length``; role pieces get their markers; when the
  last piece is a ``<user>`` turn and ``add_generation_prompt`` is true, the template's
  generation prompt follows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvreuse.pml.compiled import (
    ROOT_MODULE,
    CompiledModule,
    CompiledPrompt,
    CompiledSchema,
    NewSegment,
    SegmentKind,
)
from kvreuse.pml.encoder import TextEncoder
from kvreuse.pml.errors import PMLSemanticError
from kvreuse.pml.syntax import ModuleRef, Prompt, PromptText, Role


def _error(
    message: str, ref: ModuleRef | Prompt | None, *, module: str | None, parameter: str | None = None
) -> PMLSemanticError:
    line = ref.loc.line or None if ref is not None else None
    column = ref.loc.column or None if ref is not None else None
    return PMLSemanticError(message, module=module, parameter=parameter, line=line, column=column)


def _select(prompt: Prompt, schema: CompiledSchema) -> dict[str, ModuleRef | None]:
    """Qualified name -> the reference that selected it (``None`` for the root)."""
    selected: dict[str, ModuleRef | None] = {ROOT_MODULE: None}
    union_choice: dict[int, str] = {}

    def bind(ref: ModuleRef, scope: str) -> None:
        qualified = f"{scope}/{ref.name}" if scope else ref.name
        if not schema.has_module(qualified):
            where = f"module {scope!r}" if scope else f"the top level of schema {schema.name!r}"
            raise _error(f"unknown module {ref.name!r} in {where}", ref, module=qualified)
        module = schema.module(qualified)
        if qualified in selected:
            raise _error(f"module {qualified!r} is selected twice", ref, module=qualified)
        if module.union is not None:
            other = union_choice.get(module.union)
            if other is not None:
                raise _error(
                    f"modules {other!r} and {qualified!r} are members of one union; select at most one",
                    ref,
                    module=qualified,
                )
            union_choice[module.union] = qualified
        selected[qualified] = ref
        for child in ref.children:
            bind(child, qualified)

    for ref in prompt.refs:
        bind(ref, ROOT_MODULE)
    return selected


def _arguments(module: CompiledModule, ref: ModuleRef | None, encoder: TextEncoder) -> list[NewSegment]:
    args = dict(ref.args) if ref is not None else {}
    for name in args:
        if module.slot(name) is None:
            raise _error(
                f"module {module.qualified_name!r} has no parameter {name!r}",
                ref,
                module=module.qualified_name,
                parameter=name,
            )
    segments = []
    for slot in module.slots:
        if slot.name not in args:
            raise _error(
                f"missing argument {slot.name!r} for module {module.qualified_name!r}",
                ref,
                module=module.qualified_name,
                parameter=slot.name,
            )
        value = args[slot.name]
        token_ids = encoder.text(slot.lead + value) if value else ()
        own = len(encoder.text(value)) if value else 0
        if own > slot.length or len(token_ids) > slot.size:
            raise _error(
                f"argument {slot.name!r} of module {module.qualified_name!r} is {own} tokens, "
                f"more than the parameter's length {slot.length}",
                ref,
                module=module.qualified_name,
                parameter=slot.name,
            )
        positions = tuple(range(slot.start, slot.start + len(token_ids)))
        segments.append(NewSegment(SegmentKind.ARGUMENT, f"{module.qualified_name}:{slot.name}", token_ids, positions))
    return segments


def _uncached(module: CompiledModule, arguments: list[NewSegment]) -> NewSegment:
    """A cache="false" module: its own tokens with each slot replaced by its argument."""
    excluded = module.slot_positions
    pairs = [(p, t) for t, p in zip(module.token_ids, module.position_ids) if p not in excluded]
    pairs += [(p, t) for seg in arguments for t, p in zip(seg.token_ids, seg.position_ids)]
    pairs.sort()
    return NewSegment(
        SegmentKind.UNCACHED_MODULE,
        module.qualified_name,
        tuple(t for _, t in pairs),
        tuple(p for p, _ in pairs),
    )


def _text(
    tail: tuple[PromptText, ...], schema: CompiledSchema, encoder: TextEncoder, add_generation_prompt: bool
) -> NewSegment | None:
    token_ids: list[int] = []
    for piece in tail:
        if piece.role is None:
            token_ids += encoder.text(piece.lead + piece.text)
            continue
        markers = schema.roles.markers(piece.role)
        token_ids += encoder.markers(markers.prefix) + encoder.text(piece.text) + encoder.markers(markers.suffix)
    if add_generation_prompt and tail and tail[-1].role is Role.USER:
        token_ids += encoder.markers(schema.roles.generation_prompt)
    if not token_ids:
        return None
    positions = tuple(range(schema.length, schema.length + len(token_ids)))
    return NewSegment(SegmentKind.TEXT, "text", tuple(token_ids), positions)


def compile_prompt(
    prompt: Prompt,
    schemas: CompiledSchema | Mapping[str, CompiledSchema],
    tokenizer: Any,
    *,
    add_generation_prompt: bool = True,
) -> CompiledPrompt:
    """Bind ``prompt`` to its schema and tokenise what is new at request time.

    ``schemas`` is one compiled schema or a mapping name -> compiled schema; the prompt's
    ``schema`` attribute picks one. ``tokenizer`` must be the one the schema was compiled
    with. Raises ``PMLSemanticError`` naming the module/parameter for an unknown schema or
    module, two members of one union, a module selected twice, an unknown, missing or
    over-long argument, or a role the chat template cannot render.
    """
    if isinstance(schemas, CompiledSchema):
        schemas = {schemas.name: schemas}
    schema = schemas.get(prompt.schema)
    if schema is None:
        known = ", ".join(sorted(schemas)) or "none"
        raise _error(f"unknown schema {prompt.schema!r} (known: {known})", prompt, module=None)
    encoder = TextEncoder(tokenizer)
    selected = _select(prompt, schema)
    order = {m.qualified_name: i for i, m in enumerate(schema.modules)}
    names = tuple(sorted(selected, key=order.__getitem__))

    segments: list[NewSegment] = []
    highest = -1
    for name in names:
        module = schema.module(name)
        arguments = _arguments(module, selected[name], encoder)
        if module.cached:
            segments += [s for s in arguments if s.token_ids]
            highest = max([highest, *module.stored_position_ids])
        else:
            segments.append(_uncached(module, arguments))
    text = _text(prompt.tail, schema, encoder, add_generation_prompt)
    if text is not None:
        segments.append(text)
    highest = max([highest, *(p for s in segments for p in s.position_ids)])
    return CompiledPrompt(
        schema_name=schema.name,
        schema_hash=schema.schema_hash,
        selected_modules=names,
        segments=tuple(segments),
        next_position=highest + 1,
    )
