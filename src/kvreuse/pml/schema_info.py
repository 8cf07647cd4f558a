"""``SchemaInfo``: what registering a schema did and what it holds (the register calls' answer)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SchemaInfo"]


@dataclass(frozen=True)
class SchemaInfo:
    name: str
    schema_hash: str
    length: int  # positions of the schema; prompt text starts here
    modules: tuple[str, ...]  # qualified names of the stored modules
    stored_tokens: int  # KV tokens kept for all its modules
    precompute_tokens: int  # tokens its modules' precompute passes run (what --schema-max-tokens limits)
    kv_bytes: int  # bytes its modules' blocks take in the pool (what --schema-max-bytes limits)
    computed: int  # modules computed by this call
    loaded: int  # modules loaded from the schema dir by this call
    present: int  # modules already in the pool
    persisted: bool | None = None  # its file is in the schema dir; None: no schema dir

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "schema_hash": self.schema_hash,
            "length": self.length,
            "modules": list(self.modules),
            "stored_tokens": self.stored_tokens,
            "precompute_tokens": self.precompute_tokens,
            "kv_bytes": self.kv_bytes,
            "computed": self.computed,
            "loaded": self.loaded,
            "present": self.present,
            "persisted": self.persisted,
        }
