"""Routed replay: a trace across N simulated executors behind a routing policy.

Each simulated executor is a real ``BlockPool`` (no tensors) with its own eviction
policy; its events feed a real ``KVIndex`` in order, so the router decides exactly as the
live router would with a perfectly fresh index. Per request, in trace order:

1. compute the candidates: overlap from the index, load from the requests still in flight;
2. the policy picks an executor; the request is replayed there as in
   ``kvreuse.simulator.replay`` (hit, allocate prompt + output, register, release);
3. the request stays *in flight* (counts as load) for a modelled service time:
   ``uncached prompt tokens / prefill_tokens_per_s + output tokens * decode_s_per_token``.

Reported per policy: token hit rate over all executors, and load imbalance: for each
window of ``window_s`` trace seconds, max / mean requests per executor; the mean and the
worst window are given.
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.eviction import make_policy as make_eviction_policy
from kvreuse.cache.kv_block import cdiv
from kvreuse.cache.kv_cache_manager import KVCacheManager
from kvreuse.router.index import KVIndex, index_key
from kvreuse.router.policy import Candidate, RoutingPolicy, choose
from kvreuse.simulator.replay import kv_tokens, serve_request  # the same replay step as one pool
from kvreuse.simulator.traces import Trace, TraceRequest


@dataclass(frozen=True)
class ServiceModel:
    """How long a simulated request keeps its executor busy (only to model load)."""

    prefill_tokens_per_s: float = 20_000.0
    decode_s_per_token: float = 0.02


@dataclass(slots=True)
class RoutedResult:
    policy: str
    executors: int
    capacity_blocks: int  # per executor
    requests: int = 0
    requests_rejected: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    requests_per_executor: list[int] = field(default_factory=list)
    window_imbalance: list[float] = field(default_factory=list)  # max/mean requests per executor, per window
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def imbalance(self) -> float:
        """Mean over windows of max/mean requests per executor (1.0 = perfectly even)."""
        w = self.window_imbalance
        return sum(w) / len(w) if w else 1.0

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "executors": self.executors,
            "capacity_blocks": self.capacity_blocks,
            "hit_rate": self.hit_rate,
            "imbalance_mean": self.imbalance,
            "imbalance_max": max(self.window_imbalance, default=1.0),
            "requests": self.requests,
            "requests_rejected": self.requests_rejected,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "requests_per_executor": self.requests_per_executor,
            "windows": len(self.window_imbalance),
            "seconds": round(self.seconds, 3),
        }


class _IndexFeed:
    """An ``EventSink`` that applies a pool's events straight to the router's index."""

    def __init__(self, index: KVIndex, name: str) -> None:
        self.index, self.name = index, name

    def append(self, event) -> None:
        self.index.apply_record(self.name, event)


class SimExecutor:
    """One simulated executor: a pool, and the end times of its requests in flight."""

    def __init__(
        self, name: str, capacity_blocks: int, block_size: int, eviction_policy: str, index: KVIndex, clock
    ) -> None:
        self.name = name
        index.add_executor(name)
        self.pool = BlockPool(
            capacity_blocks,
            block_size,
            policy=make_eviction_policy(eviction_policy),
            clock=clock,
            events=_IndexFeed(index, name),
        )
        self.cache = KVCacheManager(self.pool)
        self.in_flight: list[tuple[float, int]] = []  # heap of (end time, prompt blocks)
        self.load_blocks = 0

    def retire(self, now: float) -> None:
        while self.in_flight and self.in_flight[0][0] <= now:
            self.load_blocks -= heapq.heappop(self.in_flight)[1]

    def serve(self, req: TraceRequest, index: int, result: RoutedResult, now: float, service: ServiceModel) -> None:
        """Replay one request here (the steps of ``kvreuse.simulator.replay.replay``)."""
        pool, bs = self.pool, self.pool.block_size
        if cdiv(kv_tokens(req), bs) > pool.num_blocks:  # the engine refuses it
            result.requests_rejected += 1
            return
        cached = serve_request(self.cache, req, index)
        result.prompt_tokens += req.prompt_tokens  # refused requests stay out of the hit rate
        result.cached_tokens += cached
        busy = (
            req.prompt_tokens - cached
        ) / service.prefill_tokens_per_s + req.output_tokens * service.decode_s_per_token
        prompt_blocks = cdiv(req.prompt_tokens, bs)
        heapq.heappush(self.in_flight, (now + busy, prompt_blocks))
        self.load_blocks += prompt_blocks


def simulate_routed(
    trace: Trace,
    policy: RoutingPolicy,
    *,
    executors: int,
    capacity_blocks: int,
    eviction_policy: str = "lru",
    window_s: float = 60.0,
    service: ServiceModel = ServiceModel(),
    seed: int = 0,
) -> RoutedResult:
    """Replay ``trace`` across ``executors`` pools of ``capacity_blocks`` each, routed by
    ``policy``. Raises ``ValueError`` for fewer than one executor."""
    if executors < 1:
        raise ValueError(f"--executors must be >= 1, got {executors}")
    now = 0.0
    clock = lambda: now  # noqa: E731 - the pools' clock is the trace clock
    index = KVIndex()
    sims = [
        SimExecutor(f"sim-{i}", capacity_blocks, trace.block_size, eviction_policy, index, clock)
        for i in range(executors)
    ]
    names = [s.name for s in sims]
    by_name = dict(zip(names, sims))
    rng = random.Random(seed)
    result = RoutedResult(policy.name, executors, capacity_blocks, requests_per_executor=[0] * executors)
    window_end, window_counts = window_s, [0] * executors
    started = time.perf_counter()
    for i, req in enumerate(trace.requests):
        now = max(now, req.timestamp_s)
        while now >= window_end:
            _close_window(result, window_counts)
            window_counts, window_end = [0] * executors, window_end + window_s
        keys = [index_key(k) for k in req.block_keys]
        overlaps = index.overlaps(keys, names)
        candidates = []
        for sim in sims:
            sim.retire(now)
            candidates.append(Candidate(sim.name, overlaps[sim.name], len(keys), sim.load_blocks, len(sim.in_flight)))
        decision = choose(policy, candidates, rng)
        chosen = by_name[decision.choice]
        k = names.index(decision.choice)
        result.requests += 1
        result.requests_per_executor[k] += 1
        window_counts[k] += 1
        chosen.serve(req, i, result, now, service)
    _close_window(result, window_counts)
    result.seconds = time.perf_counter() - started
    return result


def _close_window(result: RoutedResult, counts: Sequence[int]) -> None:
    total = sum(counts)
    if total:
        result.window_imbalance.append(max(counts) / (total / len(counts)))
