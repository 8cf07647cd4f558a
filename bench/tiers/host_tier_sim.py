"""Host tier in the simulator: Mooncake conversation trace, a device pool of 4,000 blocks plus
a host tier of M blocks, against one pool of 4,000 + M blocks and an infinite cache.

    .venv/bin/python bench/tiers/host_tier_sim.py [--device 4000] [--host 0 4000 8000 16000 32000 64000]

Every replay goes through the engine's admission path (``KVCacheManager`` + ``HostTier``),
policy LRU on both tiers, priority gate 35 (the trace carries no retention: every block is at
the default priority 35, so every evicted block is offloaded). Writes
bench/results/host_tier_sim.json and bench/results/host_tier_sim.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvreuse.cache.eviction import make_policy
from kvreuse.simulator.replay import replay
from kvreuse.simulator.traces import read_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, TRACE, pyplot, save_png, write_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--device", type=int, default=4000)
    ap.add_argument("--host", type=int, nargs="+", default=[0, 4000, 8000, 16000, 32000, 64000])
    ap.add_argument("--out", default=str(RESULTS / "host_tier_sim.json"))
    args = ap.parse_args()
    trace = read_trace(args.trace, block_tokens=512, trace_format="mooncake")
    infinite = replay(trace, make_policy("lru", num_blocks=trace.num_kv_blocks), trace.num_kv_blocks).hit_rate
    rows = []
    for host in args.host:
        tiered = replay(
            trace,
            make_policy("lru", num_blocks=args.device),
            args.device,
            host_blocks=host,
            host_policy=make_policy("lru", num_blocks=max(host, 1)) if host else None,
        )
        single = replay(trace, make_policy("lru", num_blocks=args.device + host), args.device + host)
        row = {
            "host_blocks": host,
            "tiered_hit_rate": round(tiered.hit_rate, 4),
            "host_share_of_prompt_tokens": round(tiered.host_cached_tokens / tiered.prompt_tokens, 4),
            "single_pool_hit_rate": round(single.hit_rate, 4),
            "vs_single_pool": round(tiered.hit_rate / single.hit_rate, 4) if single.hit_rate else None,
            "vs_infinite": round(tiered.hit_rate / infinite, 4),
            "offloaded_blocks": tiered.offloaded_blocks,
        }
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    doc = {
        "trace": Path(args.trace).name,
        "block_tokens": 512,
        "device_blocks": args.device,
        "infinite_cache_hit_rate": round(infinite, 4),
        "rows": rows,
        "command": "python bench/tiers/host_tier_sim.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    write_json(out, doc)
    print(json.dumps(doc, indent=2))

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.5))
    hosts = [r["host_blocks"] for r in rows]
    ax.plot(
        hosts, [100 * r["tiered_hit_rate"] for r in rows], marker="o", label=f"{args.device} device blocks + host tier"
    )
    ax.plot(
        hosts,
        [100 * r["single_pool_hit_rate"] for r in rows],
        "--",
        marker="s",
        label=f"one pool of {args.device} + host blocks",
    )
    ax.axhline(100 * infinite, color="gray", linestyle=":", label=f"infinite cache ({100 * infinite:.1f}%)")
    ax.set_xlabel("host-tier blocks (512 tokens each)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title("Mooncake conversation trace: a host tier below a 4,000-block pool (LRU, gate 35)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_png(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
