"""Where priority retention matters: a few short system prompts shared by every request,
and long generated outputs that fill the KV pool between two uses of a system prompt.

    .venv/bin/python bench/eviction/retention.py            # writes bench/results/retention.{json,png}

Two parts, so the end-to-end server run can be added next to the simulator run:

* ``build_workload`` returns kvreuse JSONL records (token ids, ``output_length``,
  ``kv_cache_retention_config``, ``timestamp`` ms): the same requests can be replayed by
  ``kvreuse simulate`` or sent to a server (``prompt`` as token ids, ``max_tokens`` =
  ``output_length``, ``ignore_eos``).
* ``simulate`` replays them through the block pool for each policy and capacity.

Each request = system prompt (priority 90 for 60 s) + a unique question (default 35) +
a long answer (decode priority 10). Under LRU the answers push the system prompts out;
under TensorRT-LLM priority the system prompts stay and the answers go first.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from kvreuse.simulator.plot import plot_sweep, run_policy
from kvreuse.simulator.traces import read_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, write_json

BLOCK_SIZE = 16
SYSTEM_PRIORITY, SYSTEM_DURATION_MS, DECODE_PRIORITY = 90, 60_000, 10


def build_workload(
    num_requests: int = 2000,
    *,
    num_system_prompts: int = 4,
    system_tokens: int = 256,
    question_tokens: tuple[int, int] = (16, 64),
    output_tokens: tuple[int, int] = (512, 1536),
    requests_per_s: float = 5.0,
    seed: int = 0,
) -> list[dict]:
    """kvreuse JSONL records. System prompts are picked uniformly; token ids are drawn so
    that distinct prompts never share a block by accident."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 30000) for _ in range(system_tokens)] for _ in range(num_system_prompts)]
    records = []
    for i in range(num_requests):
        system = systems[rng.randrange(num_system_prompts)]
        question = [rng.randrange(30000, 60000) for _ in range(rng.randint(*question_tokens))]
        records.append(
            {
                "prompt_token_ids": system + question,
                "output_length": rng.randint(*output_tokens),
                "timestamp": round(1000 * i / requests_per_s),
                "kv_cache_retention_config": {
                    "token_range_retention_configs": [
                        {
                            "token_start": 0,
                            "token_end": len(system),
                            "priority": SYSTEM_PRIORITY,
                            "duration_ms": SYSTEM_DURATION_MS,
                        }
                    ],
                    "decode_retention_priority": DECODE_PRIORITY,
                },
            }
        )
    return records


def write_jsonl(records: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def simulate(trace_path: Path, capacities: list[int], policies: list[str]) -> list:
    """One replay per (policy, capacity) through the real block pool."""
    trace = read_trace(trace_path, block_tokens=BLOCK_SIZE, trace_format="jsonl")
    return [run_policy(trace, name, c) for name in policies for c in capacities]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--capacity-blocks", type=int, default=256, help="headline capacity")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--keep-jsonl", action="store_true", help="keep the workload in OUT (4 MB) for a server run")
    args = p.parse_args(argv)
    workdir = args.out if args.keep_jsonl else Path(tempfile.mkdtemp(prefix="kvreuse-retention-"))
    trace_path = write_jsonl(build_workload(args.requests), workdir / "retention_workload.jsonl")
    capacities = sorted({128, 192, args.capacity_blocks, 384, 512, 768})
    results = simulate(trace_path, capacities, ["lru", "priority", "2q", "belady"])
    at = {r.policy: r for r in results if r.capacity_blocks == args.capacity_blocks}
    gain = at["priority"].hit_rate / at["lru"].hit_rate - 1 if at["lru"].hit_rate else float("inf")
    doc = {
        "workload": {"requests": args.requests, "block_size": BLOCK_SIZE, "trace": str(trace_path.name)},
        "capacity_blocks": args.capacity_blocks,
        "priority_vs_lru_gain": gain,
        "policies": [r.to_dict() for r in results if r.capacity_blocks == args.capacity_blocks],
        "sweep": [r.to_dict() for r in results],
    }
    write_json(args.out / "retention.json", doc)
    plot_sweep(results, args.out / "retention.png", "shared system prompts + long outputs (16-token blocks)")
    for r in doc["policies"]:
        print(
            f"{r['policy']:<9} hit rate {r['hit_rate']:.4f}  evictions {r['evictions']:>7}  "
            f"by priority {r['evictions_by_priority']}"
        )
    print(f"priority vs LRU at {args.capacity_blocks} blocks: {gain:+.1%} cache hits", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
