"""``kvreuse simulate --executors N --routing-policy P``: a trace across N simulated executors.

    kvreuse simulate --trace FILE --executors 4 --capacity-blocks 4000
                     [--routing-policy kv|round_robin|least_loaded ...] [--overlap-weight W]
                     [--eviction-policy lru] [--window-s 60] [--json] [--plot out.png]

``--capacity-blocks`` is per executor. Also replays one pool of ``N * capacity`` blocks
(the cache a perfect router could reach) and reports each policy's hit rate against it.
Without ``--executors`` the command is the single-pool simulator (``kvreuse.simulator.cli``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvreuse.router.policy import DEFAULT_OVERLAP_WEIGHT, POLICIES, check_overlap_weight, make_policy
from kvreuse.router.simulation import RoutedResult, simulate_routed


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvreuse simulate", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--executors", type=int, required=True, metavar="N")
    p.add_argument("--capacity-blocks", type=int, required=True, metavar="N", help="blocks per executor")
    p.add_argument(
        "--routing-policy", action="append", choices=sorted(POLICIES), help="repeatable; default: every policy"
    )
    p.add_argument("--overlap-weight", type=float, default=DEFAULT_OVERLAP_WEIGHT)
    p.add_argument("--eviction-policy", default="lru")
    p.add_argument("--window-s", type=float, default=60.0, help="imbalance window in trace seconds")
    p.add_argument(
        "--trace-block-tokens",
        "--block-size",
        dest="block_tokens",
        type=int,
        default=None,
        help="tokens per block (default 512 for Mooncake, 16 for JSONL)",
    )
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--plot", metavar="PNG", help="bar charts of hit rate and imbalance per policy")
    return p


def simulate_main(argv: Sequence[str] | None = None) -> int:
    """``kvreuse simulate``: routed when ``--executors`` is given, else the single-pool simulator."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--executors" or a.startswith("--executors=") for a in argv):
        from kvreuse.simulator.cli import simulate_main as single_pool_main

        return single_pool_main(argv)
    return routed_main(argv)


def routed_main(argv: Sequence[str]) -> int:
    from kvreuse.cache.eviction import make_policy as make_eviction_policy
    from kvreuse.simulator.replay import replay
    from kvreuse.simulator.traces import read_trace

    args = build_parser().parse_args(argv)
    if args.executors < 1 or args.capacity_blocks < 1:
        print("kvreuse simulate: --executors and --capacity-blocks must be positive", file=sys.stderr)
        return 2
    try:
        check_overlap_weight(args.overlap_weight)
        with open(args.trace) as f:
            mooncake = '"hash_ids"' in f.readline()
        block_tokens = args.block_tokens or (512 if mooncake else 16)
        trace = read_trace(args.trace, block_tokens=block_tokens, limit=args.limit)
        make_eviction_policy(args.eviction_policy)
    except (OSError, ValueError) as exc:
        print(f"kvreuse simulate: {exc}", file=sys.stderr)
        return 2
    if args.plot:  # before the replays, which can take minutes
        from kvreuse.simulator.plot import PlottingUnavailable, pyplot

        try:
            pyplot()
        except PlottingUnavailable as exc:
            print(f"kvreuse simulate: {exc}", file=sys.stderr)
            return 2
    single = replay(trace, make_eviction_policy(args.eviction_policy), args.executors * args.capacity_blocks)
    results: list[RoutedResult] = []
    for name in dict.fromkeys(args.routing_policy or ["kv", "round_robin", "least_loaded"]):
        results.append(
            simulate_routed(
                trace,
                make_policy(name, args.overlap_weight),
                executors=args.executors,
                capacity_blocks=args.capacity_blocks,
                eviction_policy=args.eviction_policy,
                window_s=args.window_s,
                seed=args.seed,
            )
        )
    doc = {
        "trace": trace.name,
        "block_size": block_tokens,
        "executors": args.executors,
        "capacity_blocks_per_executor": args.capacity_blocks,
        "eviction_policy": args.eviction_policy,
        "overlap_weight": args.overlap_weight,
        "window_s": args.window_s,
        "single_pool": {"capacity_blocks": single.capacity_blocks, "hit_rate": single.hit_rate},
        "policies": [
            {**r.to_dict(), "vs_single_pool": r.hit_rate / single.hit_rate if single.hit_rate else None}
            for r in results
        ],
    }
    if args.plot:
        plot_routed(doc, args.plot)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(
            f"{trace.name}: {args.executors} executors x {args.capacity_blocks} blocks of {block_tokens} tokens "
            f"({args.eviction_policy}); one pool of {single.capacity_blocks}: hit rate {single.hit_rate:.4f}"
        )
        print(f"{'policy':<13} {'hit rate':>9} {'x single':>9} {'imbalance':>10} {'worst':>6}  requests per executor")
        for p in doc["policies"]:
            print(
                f"{p['policy']:<13} {p['hit_rate']:>9.4f} {p['vs_single_pool']:>9.2f} {p['imbalance_mean']:>10.3f} "
                f"{p['imbalance_max']:>6.2f}  {p['requests_per_executor']}"
            )
    return 0


def plot_routed(doc: dict, path: str) -> None:
    """Two panels: hit rate per policy (with the single-pool line) and mean / worst imbalance;
    raises ``PlottingUnavailable`` when matplotlib is not installed."""
    from kvreuse.simulator.plot import pyplot

    plt = pyplot()

    names = [p["policy"] for p in doc["policies"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [p["hit_rate"] for p in doc["policies"]], color="tab:blue")
    a.axhline(
        doc["single_pool"]["hit_rate"],
        color="k",
        ls="--",
        label=f"one pool of {doc['single_pool']['capacity_blocks']} blocks",
    )
    a.axhline(0.9 * doc["single_pool"]["hit_rate"], color="gray", ls=":", label="90% of it")
    a.set_ylabel("token hit rate")
    a.set_title(f"{doc['executors']} executors x {doc['capacity_blocks_per_executor']} blocks")
    a.legend(fontsize=8)
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [p["imbalance_mean"] for p in doc["policies"]], width=0.4, label="mean")
    b.bar([i + 0.2 for i in x], [p["imbalance_max"] for p in doc["policies"]], width=0.4, label="worst window")
    b.axhline(1.25, color="gray", ls=":", label="1.25")
    b.set_xticks(list(x), names)
    b.set_ylim(1.0, max(2.0, max(p["imbalance_max"] for p in doc["policies"]) + 0.1))
    b.set_ylabel(f"max / mean requests per executor ({doc['window_s']:.0f} s windows)")
    b.legend(fontsize=8)
    fig.suptitle(f"{doc['trace']}: routing policies (overlap weight {doc['overlap_weight']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
