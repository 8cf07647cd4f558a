"""What registering a schema costs, and the limits checked before any of it is done.

A schema's cost is fixed by its compiled form, whatever the pool or the store hold now:

- ``tokens``: tokens the precompute passes run, summed over its stored modules (each pass is
  the module's own tokens plus the context it attends to: the enclosing modules' text before
  it and any scaffold), so a union of 500 members after a system turn runs that turn 500 times;
- ``blocks`` / ``bytes``: pool blocks its modules' KV takes (each module's chain rounded up to
  whole blocks), and those blocks' bytes.

``check_cost`` refuses a schema over ``SchemaLimits`` (``--schema-max-tokens``,
``--schema-max-bytes``) or larger than the pool with a ``SchemaTooLarge`` naming the limit
and the setting to change. Cheap (one walk over the modules, no tensor): it runs before the
first block is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvreuse.cache.kv_block import cdiv
from kvreuse.pml.compiled import CompiledSchema
from kvreuse.pml.errors import PMLSemanticError

DEFAULT_MAX_TOKENS = 65_536  # a union of 500 one-line members after a system turn runs ~14,000
DEFAULT_MAX_BYTES = 2**30  # 1 GiB of KV: ~23,000 tokens of SmolLM2-135M in fp32


class SchemaTooLarge(PMLSemanticError):
    """A schema over a registration limit. ``setting`` names the flag that raises it."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


@dataclass(frozen=True)
class SchemaLimits:
    """Largest schema a registration accepts; ``None``: no limit of that kind."""

    max_tokens: int | None = DEFAULT_MAX_TOKENS  # tokens of the precompute passes (--schema-max-tokens)
    max_bytes: int | None = DEFAULT_MAX_BYTES  # KV bytes its modules take in the pool (--schema-max-bytes)

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"--schema-max-tokens must be >= 1, got {self.max_tokens}")
        if self.max_bytes is not None and self.max_bytes < 1:
            raise ValueError(f"--schema-max-bytes must be >= 1, got {self.max_bytes}")


@dataclass(frozen=True)
class SchemaCost:
    tokens: int  # tokens the precompute passes of every stored module run
    blocks: int  # pool blocks the stored modules' KV takes
    bytes: int  # those blocks' bytes

    @classmethod
    def of(cls, schema: CompiledSchema, block_size: int, bytes_per_token: int) -> SchemaCost:
        tokens = blocks = 0
        for module in schema.precompute_modules:
            tokens += len(schema.precompute_input(module.qualified_name).token_ids)
            blocks += cdiv(len(module.stored_token_ids), block_size)
        return cls(tokens, blocks, blocks * block_size * bytes_per_token)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_cost(schema: CompiledSchema, cost: SchemaCost, limits: SchemaLimits, pool_blocks: int) -> None:
    """Raise ``SchemaTooLarge`` when ``cost`` is over ``limits`` or over a pool of ``pool_blocks``."""
    name, mods = schema.name, len(schema.precompute_modules)
    if limits.max_tokens is not None and cost.tokens > limits.max_tokens:
        raise SchemaTooLarge(
            f"schema {name!r} would precompute {cost.tokens} tokens ({mods} modules), over the limit of "
            f"{limits.max_tokens} (--schema-max-tokens): split it into smaller schemas or raise --schema-max-tokens",
            "--schema-max-tokens",
        )
    if limits.max_bytes is not None and cost.bytes > limits.max_bytes:
        raise SchemaTooLarge(
            f"schema {name!r} would keep {_size(cost.bytes)} of KV ({cost.bytes} bytes, {mods} modules), over "
            f"the limit of {limits.max_bytes} bytes (--schema-max-bytes): split it or raise --schema-max-bytes",
            "--schema-max-bytes",
        )
    if cost.blocks > pool_blocks:
        raise SchemaTooLarge(
            f"schema {name!r} needs {cost.blocks} KV blocks for its {mods} modules but the pool has "
            f"{pool_blocks}: split it or raise --kv-cache-memory",
            "--kv-cache-memory",
        )
