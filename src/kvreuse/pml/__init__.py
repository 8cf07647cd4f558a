"""PML front end: Prompt Markup Language text -> syntax tree -> token ids and positions.

Two separate steps (see docs/pml.md):

1. ``parse_schema(text, src_dir=...)`` / ``parse_prompt(text)`` read markup into a plain
   syntax tree (``kvreuse.pml.syntax``); no tokenizer involved.
2. ``compile_schema(schema, tokenizer, tokenizer_id=...)`` lays a schema out in
   positions and tokenises it; ``compile_prompt(prompt, compiled, tokenizer)`` binds a
   request to it. The results (``kvreuse.pml.compiled``) are the engine's contract.

All errors are ``PMLError`` (a ``ValueError``): ``PMLSyntaxError`` with line and column,
``PMLSemanticError`` naming the module/parameter.
"""

from kvreuse.pml.compiled import (
    ROOT_MODULE,
    CompiledModule,
    CompiledPrompt,
    CompiledSchema,
    NewSegment,
    ParameterSlot,
    PrecomputeInput,
    SegmentKind,
)
from kvreuse.pml.errors import PMLError, PMLSemanticError, PMLSyntaxError
from kvreuse.pml.markup import MarkupLimits
from kvreuse.pml.prompt_compiler import compile_prompt
from kvreuse.pml.prompt_parser import parse_prompt
from kvreuse.pml.roles import RoleFormat, RoleMarkers
from kvreuse.pml.schema_compiler import compile_schema
from kvreuse.pml.schema_parser import parse_schema

__all__ = [
    "ROOT_MODULE",
    "CompiledModule",
    "CompiledPrompt",
    "CompiledSchema",
    "MarkupLimits",
    "NewSegment",
    "PMLError",
    "PMLSemanticError",
    "PMLSyntaxError",
    "ParameterSlot",
    "PrecomputeInput",
    "RoleFormat",
    "RoleMarkers",
    "SegmentKind",
    "compile_prompt",
    "compile_schema",
    "parse_prompt",
    "parse_schema",
]
