"""The compiled contract between the PML front end and the engine.

Everything here is frozen, holds plain ints and strings, and never changes after
``compile_schema`` / ``compile_prompt`` built it. Positions are absolute position ids
in the schema's layout (see docs/pml.md for the picture).

Precompute (once per schema, per module in ``CompiledSchema.precompute_modules``):
    ``schema.precompute_input(name)`` gives the tokens to run in one forward pass, in
    ascending position order, with explicit ``position_ids`` and a plain causal mask
    *in that order*: the module's own tokens plus the tokens of the modules it
    ``attends_to`` (scaffolding). Keep the KV of tokens whose ``store`` flag is true:
    those are the module's own tokens outside its parameter slots. The stored KV
    therefore covers exactly ``module.stored_token_ids`` at ``module.stored_position_ids``.

Request (per ``CompiledPrompt``):
    1. Assemble the stored KV of every module in ``prompt.selected_modules`` (order of
       storage does not matter; positions do). ``schema.assembled(prompt)`` lists them.
    2. Run ``prompt.new_token_ids`` at ``prompt.new_position_ids`` (ascending) in one
       pass; each new token attends to everything assembled and, causally, to the new
       tokens before it.
    3. Decode the first generated token at ``prompt.next_position`` and count up.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property

from kvreuse.pml.errors import PMLSemanticError
from kvreuse.pml.roles import RoleFormat
from kvreuse.pml.syntax import Schema

ROOT_MODULE = ""  # qualified name of the schema root: the empty path


@dataclass(frozen=True)
class ParameterSlot:
    """Positions ``[start, end)`` of module ``module`` reserved for ``name``: the
    declared ``length`` for the value plus ``lead_tokens`` for the separator in front of
    it, so a value of exactly ``length`` tokens always fits (as in the reference, where
    ``length`` counts the argument alone).

    During precompute the slot holds the scaffold's tokens padded with the placeholder
    token; that KV is never stored. At request time the argument's tokens (``lead +
    value``, tokenised together) take the first positions of the slot and the rest stay
    empty.
    """

    module: str
    name: str
    start: int
    length: int  # the declared length: tokens of the value itself
    lead: str = ""  # separator prepended to the argument (and scaffold) before tokenising
    lead_tokens: int = 0  # tokens of ``lead`` alone; reserved on top of ``length``

    @property
    def size(self) -> int:
        """Positions reserved: what ``lead + value`` may take."""
        return self.length + self.lead_tokens

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclass(frozen=True)
class CompiledModule:
    """One precompute unit: a module's *own* tokens (nested modules are their own units).

    ``token_ids`` and ``position_ids`` have the same length, positions strictly
    ascending but not contiguous when nested modules sit in between. Slot positions are
    included (with placeholder tokens) so that later tokens see them during precompute.
    """

    qualified_name: str  # "parent/child"; "" (ROOT_MODULE) is the schema root
    name: str  # last path component; the schema name for the root
    parent: str | None  # qualified name of the enclosing module; None for the root
    union: int | None  # index (schema order) of the union this module is a member of
    start: int  # first position of the module's span (own tokens and nested modules)
    length: int  # span length; a union member's span may be shorter than the union
    token_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    slots: tuple[ParameterSlot, ...]  # in schema order
    attends_to: tuple[str, ...]  # scaffold modules seen during precompute, schema order
    cached: bool  # False: cache="false", computed per request instead of stored

    # Derived once per module (a frozen dataclass keeps them valid): every request that
    # selects the module reads them, and recomputing walks all of its tokens.
    @cached_property
    def slot_positions(self) -> frozenset[int]:
        return frozenset(p for slot in self.slots for p in range(slot.start, slot.end))

    @cached_property
    def stored_token_ids(self) -> tuple[int, ...]:
        excluded = self.slot_positions
        return tuple(t for t, p in zip(self.token_ids, self.position_ids) if p not in excluded)

    @cached_property
    def stored_position_ids(self) -> tuple[int, ...]:
        excluded = self.slot_positions
        return tuple(p for p in self.position_ids if p not in excluded)

    def slot(self, name: str) -> ParameterSlot | None:
        return next((s for s in self.slots if s.name == name), None)


@dataclass(frozen=True)
class PrecomputeInput:
    """One forward pass that precomputes ``module``; see the module docstring."""

    module: str
    token_ids: tuple[int, ...]
    position_ids: tuple[int, ...]  # strictly ascending
    store: tuple[bool, ...]  # keep this token's KV for ``module``


@dataclass(frozen=True)
class CompiledSchema:
    """A schema laid out and tokenised for one tokenizer.

    ``schema_hash`` is the sha256 (hex) of the canonical syntax tree, the role markers,
    the placeholder token and ``tokenizer_id``: equal hashes mean equal token ids and
    positions, so persisted module KV can be keyed by (model identity, schema_hash).
    """

    name: str
    schema_hash: str
    tokenizer_id: str
    length: int  # positions [0, length) are the schema; prompt text starts at length
    modules: tuple[CompiledModule, ...]  # schema (pre-)order, root first
    roles: RoleFormat
    tree: Schema = field(repr=False, compare=False)
    _by_name: dict[str, CompiledModule] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {m.qualified_name: m for m in self.modules})

    def module(self, qualified_name: str) -> CompiledModule:
        """The module called ``qualified_name``; ``PMLSemanticError`` if there is none."""
        found = self._by_name.get(qualified_name)
        if found is None:
            raise PMLSemanticError(f"schema {self.name!r} has no module {qualified_name!r}", module=qualified_name)
        return found

    def has_module(self, qualified_name: str) -> bool:
        return qualified_name in self._by_name

    @property
    def precompute_modules(self) -> tuple[CompiledModule, ...]:
        """Modules whose KV is stored: cached and with at least one stored token."""
        return tuple(m for m in self.modules if m.cached and m.stored_token_ids)

    def precompute_input(self, qualified_name: str) -> PrecomputeInput:
        """Tokens for the forward pass that precomputes ``qualified_name``."""
        module = self.module(qualified_name)
        merged = {p: (t, True) for t, p in zip(module.token_ids, module.position_ids)}
        excluded = module.slot_positions
        for context_name in module.attends_to:
            context = self.module(context_name)
            for t, p in zip(context.token_ids, context.position_ids):
                merged.setdefault(p, (t, False))
        # The text of the enclosing modules before this one (the schema's system prompt,
        # a header) is always assembled with it, so the module is encoded as its
        # continuation: one shared attention sink instead of one per module.
        ancestor = module.parent
        while ancestor is not None:
            context = self.module(ancestor)
            for t, p in zip(context.token_ids, context.position_ids):
                if p < module.start and p not in context.slot_positions:
                    merged.setdefault(p, (t, False))
            ancestor = context.parent
        positions = tuple(sorted(merged))
        return PrecomputeInput(
            module=qualified_name,
            token_ids=tuple(merged[p][0] for p in positions),
            position_ids=positions,
            store=tuple(merged[p][1] and p not in excluded for p in positions),
        )

    def assembled(self, prompt: CompiledPrompt) -> tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]:
        """(qualified name, stored token ids, stored position ids) per stored selected module."""
        if prompt.schema_hash != self.schema_hash:
            raise PMLSemanticError(f"prompt was compiled against another version of schema {self.name!r}")
        out = []
        for name in prompt.selected_modules:
            module = self.module(name)
            if module.cached and module.stored_token_ids:
                out.append((name, module.stored_token_ids, module.stored_position_ids))
        return tuple(out)


class SegmentKind(enum.Enum):
    """Why a run of new tokens is computed at request time."""

    ARGUMENT = "argument"  # a parameter's argument, at its slot's first positions
    UNCACHED_MODULE = "uncached_module"  # a cache="false" module, arguments filled in
    TEXT = "text"  # the prompt's trailing text (with role markers), from schema.length


@dataclass(frozen=True)
class NewSegment:
    """Tokens computed at request time. ``label``: "module:param", module name or "text"."""

    kind: SegmentKind
    label: str
    token_ids: tuple[int, ...]
    position_ids: tuple[int, ...]


@dataclass(frozen=True)
class CompiledPrompt:
    """A prompt bound to a compiled schema: what to assemble, what to compute, where to go on."""

    schema_name: str
    schema_hash: str
    selected_modules: tuple[str, ...]  # qualified names in schema order, root first
    segments: tuple[NewSegment, ...]  # in schema order, trailing text last
    next_position: int  # highest position assembled or computed, plus one

    @property
    def new_token_ids(self) -> tuple[int, ...]:
        """All new tokens in ascending position order."""
        return tuple(t for _, t in self._new_pairs())

    @property
    def new_position_ids(self) -> tuple[int, ...]:
        return tuple(p for p, _ in self._new_pairs())

    def _new_pairs(self) -> list[tuple[int, int]]:
        return sorted((p, t) for s in self.segments for t, p in zip(s.token_ids, s.position_ids))
