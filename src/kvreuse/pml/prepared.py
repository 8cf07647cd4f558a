"""A PML prompt compiled once, at the edge, into what the engine runs.

``prepare_prompt`` parses and compiles a ``<prompt schema=...>`` against the registered
schemas and returns a ``PreparedPrompt``: the new tokens at their explicit positions and the
``ModulePlan`` (which modules' stored KV to assemble in front of them). It touches no pool
and no model; acquiring the plan's KV is the module cache's job, when the engine queues the
request. Both results are frozen and safe to hand to another thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvreuse.pml.compiled import CompiledSchema
from kvreuse.pml.prompt_compiler import compile_prompt
from kvreuse.pml.prompt_parser import parse_prompt

if TYPE_CHECKING:
    from kvreuse.cache.kv_block import KVBlock


def is_pml_prompt(text: str) -> bool:
    """Whether ``text`` is PML prompt markup (starts with ``<prompt``, leading space allowed)."""
    return text.lstrip().startswith("<prompt")


@dataclass(frozen=True)
class ModuleContext:
    """Assembled module KV for one request (an ``engine.context.HeldKV``). ``blocks`` each
    carry one reference that the request owns; ``slots[i]`` holds the KV of the key at RoPE
    position ``positions[i]``."""

    blocks: tuple[KVBlock, ...]
    slots: tuple[int, ...]
    positions: tuple[int, ...]


@dataclass(frozen=True)
class ModulePlan:
    """Which modules a PML prompt assembles, in attention order, from which schema version;
    ``dropped`` is the index of an assembled key computed again with the new tokens (the
    highest position, when no text follows it). Enough to acquire the context again."""

    schema: CompiledSchema
    modules: tuple[str, ...]
    dropped: int | None


@dataclass(frozen=True)
class PreparedPrompt:
    """What the engine runs for a PML prompt: new tokens at explicit positions after ``context``."""

    token_ids: list[int]
    position_ids: list[int]  # ascending; the last is the highest position, so decoding follows it
    context: ModuleContext | None  # None: not acquired (prepare_prompt; the engine acquires it)
    plan: ModulePlan  # to acquire the context (again, after a release under pressure)
    next_position: int  # where decoding starts: the prompt's context length


def prepare_prompt(pml_text: str, schemas: Mapping[str, CompiledSchema], tokenizer) -> PreparedPrompt:
    """Compile ``pml_text`` against ``schemas`` (name -> compiled schema; read, not kept:
    the plan keeps its schema version). The context is ``None``. Raises ``PMLError`` naming
    line/column or the module (an unknown schema included)."""
    prompt = compile_prompt(parse_prompt(pml_text), schemas, tokenizer)
    schema = schemas[prompt.schema_name]
    assembled = schema.assembled(prompt)
    tokens = [t for _, stored, _ in assembled for t in stored]
    positions = [p for _, _, stored in assembled for p in stored]
    new_tokens, new_positions = list(prompt.new_token_ids), list(prompt.new_position_ids)
    dropped = None
    if positions and (not new_positions or max(positions) > new_positions[-1]):
        # The highest position is assembled (no trailing text): compute that one token
        # again so its logits exist and decoding continues right after it.
        dropped = max(range(len(positions)), key=positions.__getitem__)
        new_tokens.append(tokens[dropped])
        new_positions.append(positions[dropped])
    plan = ModulePlan(schema, tuple(name for name, _, _ in assembled), dropped)
    return PreparedPrompt(new_tokens, new_positions, None, plan, prompt.next_position)
