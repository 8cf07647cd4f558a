"""``kvreuse simulate``: replay a trace through the block pool with each eviction policy.

    kvreuse simulate --trace FILE --capacity-blocks N [--policy P ...] [--json]
                     (or --capacity-gib G [--host-gib H] --kv-cache-dtype int8: kv_memory.py)
                     [--plot out.png] [--trace-block-tokens 512]
                     [--host-blocks M [--host-offload-min-priority 35]]

Prints, per policy, the token-level hit rate, evictions (by priority) and Belady's
offline bound; with ``--host-blocks M`` each policy replays with a host tier of M blocks
below the pool (the engine's tier rules, through the same pool code) and the bounds are
Belady's and an infinite cache's for the combined size; ``--json`` prints one JSON document
instead; ``--plot`` also draws hit rate against capacity (``--sweep`` capacities, default
N/4 .. 4N). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvreuse.cache.eviction import POLICIES
from kvreuse.simulator.kv_memory import add_memory_arguments, resolve_capacity
from kvreuse.simulator.plot import BELADY, PlottingUnavailable, plot_sweep, pyplot, run_policy, sweep
from kvreuse.simulator.replay import ReplayResult
from kvreuse.simulator.traces import read_trace

if TYPE_CHECKING:  # rich is imported only when a bar is shown
    from rich.progress import Progress, TaskID

DEFAULT_BLOCK_TOKENS = {"mooncake": 512, "jsonl": 16}  # Mooncake ids stand for 512-token blocks


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvreuse simulate",
        description=__doc__.split("\n\n")[0],
        epilog="Routed simulation: add --executors N (with --routing-policy kv|round_robin|least_loaded, "
        "--overlap-weight W); see 'kvreuse simulate --executors 2 --help'.",
    )
    p.add_argument("--trace", required=True, help="Mooncake or kvreuse JSONL trace (docs/simulator.md)")
    p.add_argument("--capacity-blocks", type=int, default=None, metavar="N", help="pool size in blocks")
    add_memory_arguments(p)  # or --capacity-gib G in --kv-cache-dtype
    p.add_argument(
        "--policy",
        action="append",
        choices=[*POLICIES, BELADY],
        help="repeatable; default: every policy (Belady is always reported as the bound)",
    )
    p.add_argument(
        "--trace-block-tokens",
        "--block-size",
        dest="block_tokens",
        type=int,
        default=None,
        help="tokens per block (default 512 for Mooncake, 16 for JSONL)",
    )
    p.add_argument("--trace-format", choices=["auto", "mooncake", "jsonl"], default="auto")
    p.add_argument(
        "--host-blocks",
        type=int,
        default=0,
        metavar="M",
        help="a host tier of M blocks below the pool (offload on evict, onboard on a hit)",
    )
    p.add_argument(
        "--host-offload-min-priority",
        type=int,
        default=35,
        metavar="P",
        help="evicted blocks of priority >= P go to the host tier (TensorRT-LLM's default 35)",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--plot", metavar="PNG", help="also sweep capacities and draw hit rate vs capacity")
    p.add_argument("--sweep", metavar="N,N,...", help="capacities for --plot (default N/4,N/2,N,2N,4N)")
    return p


def simulate_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvreuse simulate``. Returns the exit status (2 for bad input)."""
    args = build_parser().parse_args(argv)
    fmt = args.trace_format
    if fmt == "auto":
        fmt = _sniff_format(args.trace)
    block_tokens = DEFAULT_BLOCK_TOKENS[fmt] if args.block_tokens is None else args.block_tokens
    try:
        args.capacity_blocks, args.host_blocks = resolve_capacity(args, block_tokens)
    except ValueError as e:
        print(f"kvreuse simulate: {e}", file=sys.stderr)
        return 2
    if args.capacity_blocks <= 0:
        print("kvreuse simulate: --capacity-blocks must be positive", file=sys.stderr)
        return 2
    if args.host_blocks < 0:
        print("kvreuse simulate: --host-blocks must be >= 0", file=sys.stderr)
        return 2
    if not 0 <= args.host_offload_min_priority <= 101:
        print("kvreuse simulate: --host-offload-min-priority must be in [0, 101]", file=sys.stderr)
        return 2
    if args.sweep and not args.plot:
        print("kvreuse simulate: --sweep sets the capacities of --plot; add --plot FILE.png", file=sys.stderr)
        return 2
    try:
        capacities = _capacities(args.sweep, args.capacity_blocks) if args.plot else []
        trace = read_trace(args.trace, block_tokens=block_tokens, trace_format=fmt, limit=args.limit)
    except (OSError, ValueError) as e:
        print(f"kvreuse simulate: {e}", file=sys.stderr)
        return 2
    if args.plot:  # before the replays, which can take minutes
        try:
            pyplot()
        except PlottingUnavailable as e:
            print(f"kvreuse simulate: {e}", file=sys.stderr)
            return 2
    names = list(dict.fromkeys(args.policy or POLICIES))
    capacity = args.capacity_blocks
    results: list[ReplayResult] = []
    host = args.host_blocks
    tiers = {"host_blocks": host, "offload_min_priority": args.host_offload_min_priority} if host else {}
    infinite = None
    with _Progress(len(trace.requests) * (len(names) + 1 + bool(host))) as bar:
        for name in names:
            if name == BELADY and host:
                continue  # the bound below covers it: Belady over the combined size
            results.append(run_policy(trace, name, capacity, progress=bar.advance, **tiers))
        bound = next((r for r in results if r.policy == BELADY), None) or run_policy(
            trace, BELADY, capacity + host, progress=bar.advance
        )
        if host:
            infinite = run_policy(trace, "lru", trace.num_kv_blocks, progress=bar.advance)
    results = [r for r in results if r.policy != BELADY]
    if args.plot:
        sweep_results = sweep(
            trace,
            [*names, BELADY] if BELADY not in names else names,
            capacities,
            on_done=lambda r: print(f"  sweep {r.policy} {r.capacity_blocks}: {r.hit_rate:.4f}", file=sys.stderr),
        )
        plot_sweep(sweep_results, args.plot, f"{trace.name}: hit rate vs capacity ({block_tokens}-token blocks)")
    if args.json:
        doc = {
            "trace": trace.name,
            "block_size": block_tokens,
            "capacity_blocks": capacity,
            **({} if args.capacity_gib is None else {"capacity_gib": args.capacity_gib}),
            **({} if args.capacity_gib is None else {"kv_cache_dtype": args.kv_cache_dtype}),
            "requests": len(trace.requests),
            "block_lookups": trace.num_block_lookups,
            "policies": [r.to_dict() for r in results],
            "belady": bound.to_dict(),
            **(
                {
                    "host_blocks": host,
                    "host_offload_min_priority": args.host_offload_min_priority,
                    "infinite_cache": infinite.to_dict(),
                }
                if infinite is not None
                else {}
            ),
        }
        print(json.dumps(doc, indent=2))
    else:
        _print_table(trace.name, capacity, block_tokens, results, bound, host, infinite)
    return 0


def _print_table(
    name: str,
    capacity: int,
    block_tokens: int,
    results: list[ReplayResult],
    bound: ReplayResult,
    host: int = 0,
    infinite: ReplayResult | None = None,
) -> None:
    lru = next((r.hit_rate for r in results if r.policy == "lru"), None)
    tier = f" + a host tier of {host} blocks" if host else ""
    print(f"{name}: {capacity} blocks of {block_tokens} tokens{tier}")
    print(f"{'policy':<15} {'hit rate':>9} {'x LRU':>6} {'evictions':>10}  {'seconds':>7}  evictions by priority")
    for r in [*results, bound]:
        ratio = f"{r.hit_rate / lru:.2f}" if lru else "-"
        by_prio = ", ".join(f"{p}: {n}" for p, n in sorted(r.evictions_by_priority.items()))
        label = f"{r.policy} (bound)" if r is bound else r.policy
        from_host = f"  (host: {r.host_cached_tokens / max(r.prompt_tokens, 1):.4f})" if r.host_blocks else ""
        print(f"{label:<15} {r.hit_rate:>9.4f} {ratio:>6} {r.evictions:>10}  {r.seconds:>7.2f}  {by_prio}{from_host}")
    if infinite is not None:
        print(f"{'infinite cache':<15} {infinite.hit_rate:>9.4f}   (Belady bound above: {capacity + host} blocks)")


def _sniff_format(path: str) -> str:
    """By the first non-blank line, as ``read_trace`` decides."""
    try:
        with open(path) as f:
            first = next((line for line in f if line.strip()), "")
    except OSError:
        return "jsonl"  # read_trace reports the real error
    return "mooncake" if '"hash_ids"' in first else "jsonl"


def _capacities(spec: str | None, capacity: int) -> list[int]:
    """Raises ``ValueError`` naming --sweep for anything but positive integers."""
    if spec:
        try:
            values = {int(c) for c in spec.split(",") if c.strip()}
        except ValueError:
            raise ValueError(f"--sweep takes positive block counts separated by commas, got {spec!r}") from None
        if not values or min(values) < 1:
            raise ValueError(f"--sweep takes positive block counts separated by commas, got {spec!r}")
        return sorted(values)
    return sorted({max(1, capacity // 4), max(1, capacity // 2), capacity, capacity * 2, capacity * 4})


class _Progress:
    """A rich progress bar on stderr, silent when stderr is not a terminal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self._bar: tuple[Progress, TaskID] | None = None  # while shown

    def __enter__(self) -> _Progress:
        if sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import Progress

            progress = Progress(console=Console(stderr=True), transient=True)
            progress.__enter__()
            self._bar = (progress, progress.add_task("replaying", total=self.total))
        return self

    def advance(self, n: int) -> None:
        if self._bar is not None:
            progress, task = self._bar
            progress.advance(task, n)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar[0].__exit__(*exc)
