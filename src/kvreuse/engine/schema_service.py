"""``SchemaService``: the engine's PML schemas as named operations.

The module cache (``pml/module_cache.py``: compiled schemas, their module KV) and the queue of
schemas registering while serving (``pml/registration.py``) behind the operations the engine,
``AsyncEngine`` and ``LLM`` call: compile, register a slice at a time, list, remove, size a
prompt's modules, fail what is registering. Engine thread only, unless a method says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvreuse.cache.kv_block import KVBlock
    from kvreuse.pml.compiled import CompiledSchema
    from kvreuse.pml.module_cache import ModuleCache, SchemaInfo
    from kvreuse.pml.prepared import PreparedPrompt
    from kvreuse.pml.registration import RegistrationQueue, Settle


@dataclass(frozen=True)
class Registering:
    """A schema registration in progress (``GET /v1/schemas``' ``registering``)."""

    name: str
    schema_hash: str
    modules_done: int
    modules_total: int

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "schema_hash": self.schema_hash,
            "modules_done": self.modules_done,
            "modules_total": self.modules_total,
        }


@dataclass(frozen=True)
class SchemaListing:
    """The registered schemas (by name) and the registrations still running, in queue order."""

    schemas: list[SchemaInfo]
    registering: list[Registering]


class SchemaService:
    """Named operations over ``modules`` and ``registrations`` (both the engine's)."""

    def __init__(self, modules: ModuleCache, registrations: RegistrationQueue) -> None:
        self.modules = modules
        self.registrations = registrations

    def compile(self, pml_text: str) -> CompiledSchema:
        """``ModuleCache.compile``: parse, compile and check the cost limits, computing nothing.
        Reads fixed settings only: safe on any thread. Raises ``PMLError``."""
        return self.modules.compile(pml_text)

    def submit(self, pml_text: str, settle: Settle, *, compiled: CompiledSchema | None = None) -> None:
        """Queue a registration (``compiled``: ``compile(pml_text)`` done already); it is
        precomputed a slice per ``run_slice`` and settles ``settle(SchemaInfo, False)`` once it
        serves, ``settle(exc, True)`` if it fails. Raises ``PMLError`` (nothing queued)."""
        schema = self.modules.compile(pml_text) if compiled is None else compiled
        self.registrations.submit(self.modules.start(schema, pml_text, settle=settle))

    def has_work(self) -> bool:
        return self.registrations.has_work()

    def run_slice(self, *, can_wait: bool) -> None:
        """At most ``--schema-slice-tokens`` of the registrations' precompute; with
        ``can_wait``, a registration the pool cannot hold now waits (else it fails)."""
        if self.registrations.has_work():
            self.registrations.run_slice(can_wait=can_wait)

    def fail_all(self, exc: BaseException) -> None:
        """Fail every registration still queued with ``exc`` (the engine is stopping)."""
        self.registrations.fail_all(exc)

    def held(self) -> list[KVBlock]:
        """The blocks the registrations hold now (one reference each)."""
        return self.registrations.held()

    def listing(self) -> SchemaListing:
        """Every registered schema's ``SchemaInfo`` by name, and the registrations running."""
        modules = self.modules
        return SchemaListing(
            [modules.info(name) for name in sorted(modules.schemas)],
            [
                Registering(job.schema.name, job.schema.schema_hash, job.modules_done, len(job.todo))
                for job in self.registrations
            ],
        )

    def remove(self, name: str) -> bool:
        """Forget a registered schema (its blocks fall to the default priority, its stored file
        is deleted); ``False`` if it is not registered."""
        return self.modules.remove(name)

    def module_blocks(self, prompt: PreparedPrompt) -> int:
        """Blocks the modules of a prepared PML prompt take in the pool (what its acquisition
        holds once it returns)."""
        return self.modules.blocks_of(prompt.plan)
