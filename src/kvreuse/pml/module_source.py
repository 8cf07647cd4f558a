"""A PML request's module plan bound to its cache: the ``engine.context.ContextSource``
``ModuleCache.source`` hands the engine.

The cache is reached through ``ModuleBlocks``, the four methods used here, so this module
does not import ``module_cache`` (which imports it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvreuse.pml.module_fill import PoolBusy
from kvreuse.pml.prepared import ModuleContext, ModulePlan


class ModuleBlocks(Protocol):
    """What a ``ModuleSource`` asks of its cache (``ModuleCache``)."""

    def blocks_of(self, plan: ModulePlan) -> int: ...

    def peak_blocks_of(self, plan: ModulePlan) -> int: ...

    def acquire(self, plan: ModulePlan) -> ModuleContext: ...

    def release(self, context: ModuleContext) -> None: ...


@dataclass(frozen=True)
class ModuleSource:
    """A module plan bound to its cache: the ``engine.context.ContextSource`` of a PML request."""

    cache: ModuleBlocks
    plan: ModulePlan

    @property
    def num_blocks(self) -> int:
        """The blocks an acquisition needs at once, the scratch of recomputing an evicted
        module included (``ModuleCache.peak_blocks_of``: the capacity check's peak)."""
        return self.cache.peak_blocks_of(self.plan)

    @property
    def held_blocks(self) -> int:
        """Blocks an acquisition keeps: the modules' own."""
        return self.cache.blocks_of(self.plan)

    @property
    def num_tokens(self) -> int:
        schema = self.plan.schema
        stored = sum(len(schema.module(name).stored_token_ids) for name in self.plan.modules)
        return stored - (self.plan.dropped is not None)

    private_blocks = False  # a module's blocks are shared with every request that selects it

    def assembled_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """``([num_tokens] int64 token ids of the context keys in attention order, [s] int64
        first key index of each module)`` (``engine.blended_context.SegmentedSource``; the
        dropped key, computed with the new tokens, is not a key)."""
        schema = self.plan.schema
        stored = [schema.module(name).stored_token_ids for name in self.plan.modules]
        tokens = np.asarray([t for ids in stored for t in ids], dtype=np.int64)  # [n + dropped]
        lengths = np.asarray([len(ids) for ids in stored], dtype=np.int64)  # [modules]
        starts = np.cumsum(lengths) - lengths  # [modules]
        if self.plan.dropped is not None:
            tokens = np.delete(tokens, self.plan.dropped)
            starts = starts - (starts > self.plan.dropped)
        return tokens, np.unique(starts[starts < len(tokens)])

    def acquire(self) -> ModuleContext | None:
        """``ModuleCache.acquire``; ``None`` when the pool is busy (nothing held then)."""
        try:
            return self.cache.acquire(self.plan)
        except PoolBusy:
            return None

    def release(self, held: ModuleContext) -> None:
        self.cache.release(held)
