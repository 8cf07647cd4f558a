"""Eviction policies on the Mooncake conversation trace: hit rate vs capacity, and timing.

    .venv/bin/python bench/eviction/simulate_sweep.py
    # -> docs/img/policy_sweep.png, bench/results/policy_sweep.json

Same replay as ``kvreuse simulate`` (docs/simulator.md). ``priority`` is left out: the trace
carries no retention hints, so it replays exactly like ``lru``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvreuse.simulator.plot import plot_sweep, sweep
from kvreuse.simulator.traces import read_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, ROOT, TRACE, write_json


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=TRACE)
    p.add_argument("--capacities", default="1000,2000,4000,8000,16000,32000")
    p.add_argument("--policies", default="lru,2q,logfreq,belady")
    p.add_argument("--png", type=Path, default=ROOT / "docs/img/policy_sweep.png")
    p.add_argument("--json", type=Path, default=RESULTS / "policy_sweep.json")
    args = p.parse_args(argv)
    started = time.perf_counter()
    trace = read_trace(args.trace, block_tokens=512, trace_format="mooncake")
    read_s = time.perf_counter() - started
    capacities = [int(c) for c in args.capacities.split(",")]
    results = sweep(
        trace,
        args.policies.split(","),
        capacities,
        on_done=lambda r: print(
            f"{r.policy:<7} {r.capacity_blocks:>6} blocks: hit rate {r.hit_rate:.4f}  ({r.seconds:.1f} s)",
            file=sys.stderr,
        ),
    )
    plot_sweep(results, args.png, "Mooncake conversation trace: hit rate vs capacity (512-token blocks)")
    write_json(
        args.json,
        {
            "trace": trace.name,
            "requests": len(trace.requests),
            "block_lookups": trace.num_block_lookups,
            "read_seconds": round(read_s, 2),
            "results": [r.to_dict() for r in results],
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
