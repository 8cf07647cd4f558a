"""The PML syntax tree: plain frozen data, no tokenizer anywhere.

A schema is a tree of body items (``Text``, ``Parameter``, ``RoleBlock``, ``Module``,
``Union``) in document order. A prompt is a list of ``ModuleRef`` followed by trailing
``PromptText`` pieces. ``loc`` fields locate the element in its document for error
messages; they take no part in equality or in the schema hash.

Whitespace is already normalised here (see ``kvreuse.pml.text``): ``Text.text`` has no
leading or trailing whitespace, and ``lead`` is the single separator ("", " " or "\\n")
that the tokenizer sees in front of it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SourceLocation:
    """1-based line and column of an element's start tag."""

    line: int
    column: int


NOWHERE = SourceLocation(0, 0)  # for trees built in code rather than parsed


class Role(enum.Enum):
    """Chat roles a role tag stands for; rendered through the model's chat template."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True)
class Text:
    """Literal text; the tokenizer sees ``lead + text``."""

    text: str
    lead: str = ""
    loc: SourceLocation = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class Parameter:
    """A slot of ``length`` positions filled by a request argument.

    ``scaffold`` is the stand-in text placed in the slot while the module is precomputed
    (``None``: placeholder tokens only). ``lead`` is prepended to the argument (and the
    scaffold) before tokenising, so "for <param/> days" reads "for 3 days".
    """

    name: str
    length: int
    scaffold: str | None = None
    lead: str = ""
    loc: SourceLocation = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class RoleBlock:
    """A chat turn: the role's prefix markers, the body, the role's suffix markers."""

    role: Role
    body: tuple[BodyItem, ...]
    loc: SourceLocation = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class Module:
    """A reusable segment with its own KV. ``cache=False``: computed per request."""

    name: str
    body: tuple[BodyItem, ...]
    cache: bool = True
    loc: SourceLocation = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class Union:
    """Mutually exclusive modules sharing one start position.

    ``scaffold`` names the member that stands in for the union while the enclosing
    module's later tokens are precomputed (``None``: they see no member).
    """

    members: tuple[Module, ...]
    scaffold: str | None = None
    loc: SourceLocation = field(default=NOWHERE, compare=False)


BodyItem = Text | Parameter | RoleBlock | Module | Union


@dataclass(frozen=True)
class Schema:
    """The root module of a schema: always part of every prompt that uses it."""

    name: str
    body: tuple[BodyItem, ...]
    loc: SourceLocation = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class ModuleRef:
    """``<name arg="value"><child/></name>`` in a prompt: select a module, bind arguments."""

    name: str
    args: tuple[tuple[str, str], ...] = ()
    children: tuple[ModuleRef, ...] = ()
    loc: SourceLocation = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class PromptText:
    """Trailing request text, bare (``role=None``) or inside a role tag."""

    text: str
    role: Role | None = None
    lead: str = ""
    loc: SourceLocation = field(default=NOWHERE, compare=False)


@dataclass(frozen=True)
class Prompt:
    """``<prompt schema="...">``: module references, then trailing text pieces."""

    schema: str
    refs: tuple[ModuleRef, ...]
    tail: tuple[PromptText, ...]
    loc: SourceLocation = field(default=NOWHERE, compare=False)
