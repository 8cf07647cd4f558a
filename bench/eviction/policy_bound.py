"""Upper bound on the hit rate of a *history-only* eviction policy on the Mooncake trace.

    .venv/bin/python bench/eviction/policy_bound.py [--capacity 4000]
    # -> bench/results/policy_bound.json

Issue 3 asks for a hint-free policy at 2.5x LRU at 4,000 blocks. This script bounds what
any policy that ranks blocks by their access history (uses, recency, reuse gaps) can
reach there, generously, so the gap between ``logfreq`` and the target can be judged.

A history-only policy cannot tell a block seen once that will be reused from one that
will not (three in four will not). Split the capacity ``C = C1 + C2``:

* ``C2`` blocks serve reuses of blocks already reused once: granted Belady's optimum on
  that sub-stream (perfect foresight, more than any online policy gets);
* ``C1`` blocks serve *first* reuses: blocks seen once are alike, so the best a policy
  can do is keep a fraction ``C1 / T`` of them (chosen blindly, e.g. by hash) for ``T``
  new blocks each; it catches ``(C1 / T) * F(T)`` first reuses, ``F(T)`` = first reuses
  that come within ``T`` new blocks of the first use; the best ``T`` is taken;
* the root block (shared by every request) always hits.

Prefix semantics (a hit needs all earlier blocks resident) and leaf-only eviction are
ignored, and output / partial blocks do not count against the distances: all of these
only lower what a real policy gets. Hit rate is token-level, as ``kvreuse simulate``.
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import Counter
from pathlib import Path

import numpy as np

from kvreuse.cache.eviction import LRUPolicy
from kvreuse.cache.hashing import BlockHash
from kvreuse.simulator.replay import hit_blocks, replay
from kvreuse.simulator.traces import Trace, read_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import ROOT, TRACE, write_json

BLOCK = 512


def _streams(trace: Trace):
    """Full prompt blocks in order -> (root hits, first-reuse distances in new blocks,
    the sub-stream of second-and-later uses as (key, counts_as_hit), prompt tokens)."""
    uses: Counter = Counter()
    first_seen: dict[BlockHash, int] = {}
    new_blocks = root_hits = prompt_tokens = 0
    first_dist: list[int] = []
    later: list[tuple[BlockHash, bool]] = []
    roots = set()
    for req in trace.requests:
        prompt_tokens += req.prompt_tokens
        eligible = hit_blocks(req, BLOCK)  # the block of the last prompt token is never a hit
        for j, key in enumerate(req.block_keys):  # the simulator's keys of full blocks
            u = uses[key]
            uses[key] = u + 1
            if j == 0:  # the root: one block, always worth keeping
                root_hits += u > 0 and j < eligible
                roots.add(key)
                continue
            if u == 0:
                new_blocks += 1
                first_seen[key] = new_blocks
            elif u == 1 and j < eligible:
                first_dist.append(new_blocks - first_seen[key])
                later.append((key, False))  # admitted here, not a hit for a history-only policy
            else:  # a later use; no hit where the block holds the prompt's last token
                later.append((key, j < eligible))
    return root_hits, np.array(first_dist), later, prompt_tokens, len(roots)


FEATURES = {  # what a policy sees of a block when it is first stored, and bucket edges
    "prompt_tokens": (2_000, 5_000, 10_000, 20_000, 40_000),
    "output_tokens": (10, 50, 150, 300, 500, 800),
    "new_blocks_in_request": (2, 4, 8, 16, 32),
    "depth_in_chain": (2, 4, 8, 16, 32, 64),
    "request_reused_a_prefix": (1,),
}


def _first_sight(trace: Trace) -> dict[str, dict[str, dict[str, float]]]:
    """P(a first-seen non-root block is ever used again), bucketed by each feature a
    history-free predictor could use when the block is stored: the evidence that blocks
    seen once look alike (the premise of the C1 term)."""
    last_use: dict[BlockHash, int] = {}
    for i, req in enumerate(trace.requests):
        for key in req.block_keys:
            last_use[key] = i
    seen: set[BlockHash] = set()
    tallies = {
        name: {label: [0, 0] for label in (*(f"<{e}" for e in edges), f">={edges[-1]}")}
        for name, edges in FEATURES.items()
    }
    for i, req in enumerate(trace.requests):
        new = [(j, key) for j, key in enumerate(req.block_keys) if j > 0 and key not in seen]
        continued = int(len(req.block_keys) > 1 and req.block_keys[1] in seen)
        seen.update(req.block_keys)
        for j, key in new:
            values = {
                "prompt_tokens": req.prompt_tokens,
                "output_tokens": req.output_tokens,
                "new_blocks_in_request": len(new),
                "depth_in_chain": j,
                "request_reused_a_prefix": continued,
            }
            for name, edges in FEATURES.items():
                bucket = next((f"<{e}" for e in edges if values[name] < e), f">={edges[-1]}")
                tally = tallies[name][bucket]
                tally[0] += last_use[key] > i
                tally[1] += 1
    return {
        name: {b: {"p_reused": a / n, "blocks": n} for b, (a, n) in buckets.items() if n}
        for name, buckets in tallies.items()
    }


def _belady_hits(stream: list[tuple[BlockHash, bool]], capacity: int) -> int:
    """Hits (on accesses flagged True) of Belady's optimum over ``stream``."""
    if capacity <= 0:
        return 0
    nxt = [0] * len(stream)
    seen: dict[BlockHash, int] = {}
    for k in range(len(stream) - 1, -1, -1):
        nxt[k] = seen.get(stream[k][0], 1 << 60)
        seen[stream[k][0]] = k
    resident: dict[BlockHash, int] = {}
    heap: list[tuple[int, BlockHash]] = []  # (-next use, key); stale entries skipped
    hits = 0
    for k, (key, counts) in enumerate(stream):
        if key in resident:
            hits += counts
        elif len(resident) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if resident.get(victim) == -neg:
                    del resident[victim]
                    break
        resident[key] = nxt[k]
        heapq.heappush(heap, (-nxt[k], key))
    return hits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--capacity", type=int, default=4000)
    p.add_argument("--step", type=int, default=250, help="granularity of the C1 / C2 split")
    p.add_argument("--lru", type=float, default=None, help="LRU hit rate to compare with (default: replay it)")
    p.add_argument("--json", type=Path, default=ROOT / "bench/results/policy_bound.json")
    args = p.parse_args(argv)
    trace = read_trace(args.trace, block_tokens=BLOCK, trace_format="mooncake")  # read once, for both
    root_hits, first_dist, later, prompt_tokens, n_roots = _streams(trace)
    if args.lru is None:
        args.lru = replay(trace, LRUPolicy(), args.capacity).hit_rate
    to_rate = BLOCK / prompt_tokens
    horizons = range(250, 200_001, 250)
    counts = np.searchsorted(np.sort(first_dist), np.array(horizons), side="left")  # F(T): dist < T
    splits = []
    capacity = args.capacity - n_roots
    for c1 in range(0, capacity + 1, args.step):
        first = max(float(f) * min(1.0, c1 / t) for t, f in zip(horizons, counts)) if c1 else 0.0
        later_hits = _belady_hits(later, capacity - c1)
        rate = (root_hits + first + later_hits) * to_rate
        splits.append(
            {"c1_first_use": c1, "first_reuse_hits": round(first, 1), "later_reuse_hits": later_hits, "hit_rate": rate}
        )
        print(f"C1={c1:>5}  first-reuse hits {first:8.1f}  later-reuse hits {later_hits:6d}  bound {rate:.4f}")
    best = max(splits, key=lambda s: s["hit_rate"])
    out = {
        "trace": args.trace.name,
        "capacity_blocks": args.capacity,
        "lru_hit_rate": args.lru,
        "bound_hit_rate": best["hit_rate"],
        "bound_vs_lru": best["hit_rate"] / args.lru,
        "target_vs_lru": 2.5,
        "best_split": best,
        "root_hits": root_hits,
        "first_reuses": int(len(first_dist)),
        "later_reuses": sum(c for _, c in later),
        "first_sight_features": _first_sight(trace),
        "splits": splits,
    }
    for name, buckets in out["first_sight_features"].items():
        print(
            f"P(reused) of first-seen blocks by {name}: "
            + ", ".join(f"{b} {v['p_reused']:.2f} ({v['blocks']})" for b, v in buckets.items())
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.json, out)
    print(
        f"history-only bound at {args.capacity} blocks: {best['hit_rate']:.4f} = "
        f"{best['hit_rate'] / args.lru:.2f}x LRU ({args.lru:.4f}); target 2.5x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
