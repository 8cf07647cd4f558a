"""Replay a trace through the real ``BlockPool`` in simulated mode (no model, no tensors).

The replay model, in order, for every request (requests run one after another, at their
arrival time; the pool's clock is the trace clock, so retention durations expire in trace
time):

1. **Lookup**: the longest run of leading prompt blocks already resident is a hit
   (prefix semantics); the pool takes a reference on them and the request's retention
   is applied to them (``set_retention``: priority when given, duration always).
2. **Allocate**: the request then holds every block of its prompt *and* its output,
   ``ceil((prompt + output) / block_size)`` in all, evicting cached leaves as needed.
   A request that cannot fit even in an empty pool is counted in ``requests_rejected``.
3. **Register**: every full block is cached with its retention: prompt blocks under their
   trace keys, blocks from the prompt's partial tail on under keys unique to the request
   (their tokens are unknown, they are never hit again, but they occupy the cache like a
   real engine's generated blocks). Blocks whose first token is generated take the
   decode priority.
4. **Release**: all blocks, tail first (so, within a tick, the deepest block is evicted first).

Token-level hit rate = cached prompt tokens / prompt tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.eviction import EvictionPolicy
from kvreuse.cache.hashing import hash_block
from kvreuse.cache.host_tier import HostTier, OffloadPolicy
from kvreuse.cache.kv_block import DEFAULT_PRIORITY, cdiv
from kvreuse.cache.kv_cache_manager import KVCacheManager
from kvreuse.cache.retention import requested_retention
from kvreuse.simulator.traces import Trace

DECODE_EXTRA_KEY = "sim-output"  # marks the synthetic keys of output blocks


@dataclass(slots=True)
class ReplayResult:
    policy: str
    capacity_blocks: int
    requests: int = 0
    requests_rejected: int = 0  # larger than the whole pool
    prompt_tokens: int = 0
    cached_tokens: int = 0
    evictions: int = 0
    evictions_by_priority: dict[int, int] = field(default_factory=dict)
    blocks_by_priority: dict[int, int] = field(default_factory=dict)  # at the end of the trace
    seconds: float = 0.0  # wall time of the replay
    host_blocks: int = 0  # host tier below the pool (0: none)
    host_cached_tokens: int = 0  # of cached_tokens, onboarded from the host tier
    offloaded_blocks: int = 0  # device evictions kept by the host tier

    @property
    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens (0 for an empty trace)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "capacity_blocks": self.capacity_blocks,
            "hit_rate": self.hit_rate,
            "requests": self.requests,
            "requests_rejected": self.requests_rejected,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "evictions": self.evictions,
            "evictions_by_priority": {str(k): v for k, v in sorted(self.evictions_by_priority.items())},
            "blocks_by_priority": {str(k): v for k, v in sorted(self.blocks_by_priority.items())},
            "seconds": round(self.seconds, 3),
            **(
                {
                    "host_blocks": self.host_blocks,
                    "host_cached_tokens": self.host_cached_tokens,
                    "offloaded_blocks": self.offloaded_blocks,
                }
                if self.host_blocks
                else {}
            ),
        }


def replay(
    trace: Trace,
    policy: EvictionPolicy,
    capacity_blocks: int,
    *,
    on_request: Callable[[int], None] | None = None,
    progress: Callable[[int], None] | None = None,
    check_every: int = 0,
    host_blocks: int = 0,
    host_policy: EvictionPolicy | None = None,
    offload_min_priority: int = DEFAULT_PRIORITY,
) -> ReplayResult:
    """Replay ``trace`` through a fresh ``BlockPool`` of ``capacity_blocks`` blocks.

    ``on_request(i)`` runs before request ``i`` (Belady's policy learns the future there);
    ``progress(n)`` is told each ``n`` requests done; ``check_every > 0`` runs
    ``check_integrity`` every that many requests (tests). ``host_blocks > 0`` puts a host
    tier of that many blocks below the pool (``host_policy``, default LRU), which keeps
    evicted blocks of priority >= ``offload_min_priority``, through the engine's own
    admission path. Raises ``ValueError`` for a non-positive capacity.
    """
    now = 0.0
    host = None
    if host_blocks:
        host = HostTier(
            host_blocks,
            trace.block_size,
            policy=host_policy,
            clock=lambda: now,
            offload_policy=OffloadPolicy(offload_min_priority),
        )
    pool = BlockPool(
        capacity_blocks, trace.block_size, policy=policy, clock=lambda: now, record_evictions=host is not None
    )
    cache = KVCacheManager(pool, lower=host)
    result = ReplayResult(policy.name, capacity_blocks)
    bs = trace.block_size
    started = time.perf_counter()
    for i, req in enumerate(trace.requests):
        now = max(now, req.timestamp_s)
        result.requests += 1
        total = kv_tokens(req)
        if cdiv(total, bs) > capacity_blocks:  # the engine refuses it (400): not part of the hit rate
            result.requests_rejected += 1
            if progress is not None:
                progress(1)
            continue
        if on_request is not None:
            on_request(i)
        result.prompt_tokens += req.prompt_tokens
        result.cached_tokens += serve_request(cache, req, i)
        if progress is not None:
            progress(1)
        if check_every and (i + 1) % check_every == 0:
            pool.check_integrity()
            if host is not None:
                host.check_integrity()
    result.seconds = time.perf_counter() - started
    result.evictions = pool.num_evictions
    result.evictions_by_priority = dict(pool.evictions_by_priority)
    result.blocks_by_priority = pool.blocks_by_priority()
    if host is not None:
        result.host_blocks = host_blocks
        result.host_cached_tokens = host.stats.onboarded_blocks * bs
        result.offloaded_blocks = host.stats.offloaded_blocks
    return result


def serve_request(cache: KVCacheManager, req, index: int) -> int:
    """One request in ``cache``'s pool as the engine runs it alone, through the engine's own
    admission path: hit its cached prefix, hold prompt + output, cache every full block,
    release. Returns the cached prompt tokens. The caller checks first that the request fits
    the pool at all (``kv_tokens``). Raises ``RuntimeError`` if it fits but finds no room
    (a leak)."""
    bs = cache.block_size
    total = kv_tokens(req)
    retention = requested_retention(req.retention, total, bs, num_prompt_tokens=req.prompt_tokens)
    asked = (lambda j: None) if req.retention is None else retention.__getitem__
    admission = cache.admit_blocks(
        req.block_keys, req.block_tokens, num_blocks=cdiv(total, bs), max_hits=hit_blocks(req, bs), retention=asked
    )
    if admission is None:
        raise RuntimeError(f"request {index} fits the pool but found no room: blocks are leaking")
    blocks = list(admission.blocks)
    keys, tokens = _block_keys(req, index, total // bs)
    cache.register_blocks(blocks, keys, tokens, admission.num_hits, total // bs, retention=asked)
    cache.pool.release(reversed(blocks))
    return admission.num_hits * bs


def kv_tokens(req) -> int:
    """Tokens a request keeps KV for in the engine: its prompt and every generated token
    but the last (the last sampled token is never fed back)."""
    return req.prompt_tokens + max(req.output_tokens - 1, 0)


def hit_blocks(req, block_size: int) -> int:
    """Leading prompt blocks a request can take from the cache: never the one holding its
    last prompt token, whose logits must be computed (the engine's rule)."""
    return min(len(req.block_keys), max(req.prompt_tokens - 1, 0) // block_size)


def _block_keys(req, index: int, n_full: int) -> tuple[list, list]:
    """Keys and tokens of the request's first ``n_full`` blocks: prompt blocks under their
    trace keys, the rest under keys unique to request ``index`` (their tokens are unknown)."""
    keys, tokens = list(req.block_keys[:n_full]), list(req.block_tokens[:n_full])
    parent = keys[-1] if keys else None
    for j in range(len(keys), n_full):
        parent = hash_block(parent, (index, j), (DECODE_EXTRA_KEY, index))
        keys.append(parent)
        tokens.append((index, j))
    return keys, tokens
