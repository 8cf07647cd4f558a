"""Belady's offline policy: evict the block whose next use lies furthest in the future.

A reference for the simulator only (it reads the whole trace ahead). Keys are computed when
a block becomes evictable; a released block's next use cannot change while it sits unused
(its next use *is* the next access), so a key computed then stays exact. Blocks never used
again (including every output block) go first; ties evict the deeper block first.

With leaves-only eviction this is Belady restricted to the prefix tree, which is also
optimal there: a child is never used without its parent, so a parent's next use is never
later than its child's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvreuse.cache.eviction import EvictionPolicy
from kvreuse.cache.hashing import BlockHash
from kvreuse.cache.kv_block import cdiv
from kvreuse.simulator.replay import ReplayResult, hit_blocks, kv_tokens, replay
from kvreuse.simulator.traces import Trace

if TYPE_CHECKING:
    from kvreuse.cache.kv_block import KVBlock


class BeladyPolicy(EvictionPolicy):
    """Sort key ``(-next use, -depth)``. Call ``start_request(i)`` before request ``i``."""

    name = "belady"

    def __init__(self, trace: Trace, capacity_blocks: int | None = None) -> None:
        # next_after[i][j]: index of the next request after i that can hit request i's j-th
        # prompt key (math.inf if none); built backwards in one pass. Only what the replay
        # counts is a use: keys a request may hit (not the block of its last prompt token),
        # in requests that run at all (those over ``capacity_blocks`` are refused).
        bs = trace.block_size
        upcoming: dict[BlockHash, float] = {}
        next_after: list[list[float]] = [[] for _ in trace.requests]
        for i in range(len(trace.requests) - 1, -1, -1):
            req = trace.requests[i]
            next_after[i] = [upcoming.get(k, math.inf) for k in req.block_keys]
            if capacity_blocks is None or cdiv(kv_tokens(req), bs) <= capacity_blocks:
                for k in req.block_keys[: hit_blocks(req, bs)]:
                    upcoming[k] = i
        self._trace = trace
        self._next_after = next_after
        self._next_use: dict[BlockHash | None, float] = {}  # key -> next request index that needs it (None: never)

    def start_request(self, index: int) -> None:
        """Request ``index`` runs now: its keys' next uses move to the following occurrence.
        (The keys are set before the request releases its blocks, which is when they are keyed.)"""
        for key, nxt in zip(self._trace.requests[index].block_keys, self._next_after[index]):
            self._next_use[key] = nxt

    def sort_key(self, block: KVBlock) -> tuple:
        return (-self._next_use.get(block.block_hash, math.inf), -block.depth)


def replay_belady(trace: Trace, capacity_blocks: int, **kwargs) -> ReplayResult:
    """Replay ``trace`` with ``BeladyPolicy`` (the upper reference for every online policy)."""
    policy = BeladyPolicy(trace, capacity_blocks)
    return replay(trace, policy, capacity_blocks, on_request=policy.start_request, **kwargs)
