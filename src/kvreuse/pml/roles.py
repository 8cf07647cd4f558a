"""How role tags become text: markers taken from the model's chat template.

``RoleFormat.from_tokenizer`` renders tiny conversations through
``tokenizer.apply_chat_template`` with a sentinel as the message content and cuts the
rendered text around the sentinel. A role's markers are what the template adds *for that
message*: the text it appends when the message is added to a conversation (system: the
whole conversation ``[system]``; user: ``[system] -> [system, user]``; assistant:
``[system, user] -> [system, user, assistant]``). The generation prompt is what
``add_generation_prompt=True`` appends after a user turn.

Consequences, documented on purpose:
- PML renders exactly the turns it is given: a template's default system prompt (one it
  injects when a conversation does not start with a system turn) is never added.
- A template that is not append-only (it rewrites earlier turns when a later one is
  added, e.g. folds the system prompt into the first user turn) gives no markers for
  the affected role; using that role tag then raises ``PMLSemanticError``.
- A tokenizer without a chat template uses ``RoleFormat.plain()``: system text followed
  by a blank line, ``"User: "``/``"Assistant: "`` prefixes each ended by a newline, and
  ``"Assistant:"`` as the generation prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvreuse.pml.errors import PMLSemanticError
from kvreuse.pml.syntax import Role

_SENTINEL = "PMLCONTENTf3a9c1"
_FILLER = {"system": "PMLSYSTEMb71e", "user": "PMLUSERc02d", "assistant": "PMLASSISTANTd44a"}


@dataclass(frozen=True)
class RoleMarkers:
    """The text a role adds before and after its content."""

    prefix: str
    suffix: str


@dataclass(frozen=True)
class RoleFormat:
    """Markers for every role; ``None`` where the template cannot render that role alone."""

    system: RoleMarkers | None
    user: RoleMarkers | None
    assistant: RoleMarkers | None
    generation_prompt: str
    source: str  # "chat_template" or "plain"; part of the schema hash

    def markers(self, role: Role, *, module: str | None = None) -> RoleMarkers:
        """Markers for ``role``. Raises ``PMLSemanticError`` when the format has none."""
        found = getattr(self, role.value)
        if found is None:
            raise PMLSemanticError(f"the chat template cannot render a <{role.value}> turn on its own", module=module)
        return found

    @classmethod
    def plain(cls) -> RoleFormat:
        """The documented fallback for tokenizers without a chat template."""
        return cls(
            system=RoleMarkers("", "\n\n"),
            user=RoleMarkers("User: ", "\n"),
            assistant=RoleMarkers("Assistant: ", "\n"),
            generation_prompt="Assistant:",
            source="plain",
        )

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> RoleFormat:
        """Derive markers from ``tokenizer``'s chat template, or ``plain()`` without one."""
        if not getattr(tokenizer, "chat_template", None):
            return cls.plain()

        def render(roles: list[str], *, generation: bool = False) -> str | None:
            messages = [{"role": r, "content": _FILLER[r]} for r in roles]
            try:
                return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
            except Exception:  # noqa: BLE001 - templates raise arbitrary errors for unsupported roles
                return None

        def added(before: list[str], role: str) -> RoleMarkers | None:
            base = render(before) if before else ""
            messages = [{"role": r, "content": _FILLER[r]} for r in before]
            messages.append({"role": role, "content": _SENTINEL})
            try:
                full = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
            except Exception:  # noqa: BLE001 - as in render(): this role is not supported
                return None
            if base is None or not isinstance(full, str) or not full.startswith(base):
                return None
            delta = full[len(base) :]
            if delta.count(_SENTINEL) != 1:
                return None
            prefix, suffix = delta.split(_SENTINEL)
            return RoleMarkers(prefix, suffix)

        without = render(["system", "user"])
        with_generation = render(["system", "user"], generation=True)
        generation_prompt = ""
        if without is not None and with_generation is not None and with_generation.startswith(without):
            generation_prompt = with_generation[len(without) :]
        return cls(
            system=added([], "system"),
            user=added(["system"], "user"),
            assistant=added(["system", "user"], "assistant"),
            generation_prompt=generation_prompt,
            source="chat_template",
        )
