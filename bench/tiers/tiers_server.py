"""A Mooncake-shaped workload through real ``kvreuse serve`` processes, with and without
the host tier: token hit rate (from ``usage.prompt_tokens_details.cached_tokens``) and TTFT.

    .venv/bin/python bench/tiers/tiers_server.py [--quick] [--requests 60] [--seed 1] [--device-blocks 80]
                                           [--host-gib 1.0] [--model default]

The workload is derived from the shipped trace ``data/traces/mooncake_conversation_trace.jsonl``
(one hash id per 512-token block; equal ids at equal positions = the same prefix):

1. Conversations: the trace's requests grouped by their first two hash ids (every request
   starts with block 0, a shared system prompt; the second id starts a conversation, whose
   later turns extend it). Whole conversations are drawn with ``random.Random(--seed)``
   until ``--requests`` requests (seed 1: of seeds 0-3 the sample whose infinite-cache hit
   rate is closest to the whole trace's), then replayed in trace order: the shared system block,
   multi-turn growth and the interleaving of conversations (reuse distances: many other
   blocks between two turns of one conversation) are the trace's.
2. Scale: each hash id becomes ``--tokens-per-id`` (16, one block) token ids drawn from
   ``random.Random(id)``, so 512 trace tokens are 16 served tokens (1/32); a prompt is
   ``input_length / 32`` tokens of its ids' blocks, at most ``--max-prompt`` (1,024). The
   default model then serves the whole run in minutes on two CPU cores.
3. Outputs are not generated (``max_tokens`` 1: the latency of the call is the TTFT); the
   trace's next turn already carries the previous turns as hash ids.

Two servers of the same model with the same device pool of ``--device-blocks`` blocks (it
must hold one prompt): one without a tier below it, one with ``--host-cache-memory
--host-gib``. Requests go one at a time, in trace order, each to both servers back to back
(the order alternating), so machine noise hits both alike. ``--reps N`` replays the whole
workload N times, each from a cold cache (``POST /reset_prefix_cache``): the hits are the
same every time (checked), each request's TTFT is the median of its N. Beside the measured hit rates:
the simulator's replay of the same workload through the same pool code (``kvreuse.simulator``),
an infinite cache, and the reuse distances of the workload.

Writes bench/results/tiers_server.json and .png (``--quick``: tiers_server_quick.*).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvreuse.cache.eviction import make_policy
from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.models.loader import shape_from_config
from kvreuse.simulator.replay import replay
from kvreuse.simulator.traces import Trace, TraceRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, TRACE, free_port, pyplot, running_servers, save_png, write_json
from tests.serve_client import complete, metric

TRACE_BLOCK = 512  # tokens per hash id in the trace
BLOCK = 16  # the server's --block-size (its default)
CONFIGS = ("device_only", "host_tier")


# ---------------------------------------------------------------------------- workload
def derive_workload(
    trace: Path, *, requests: int, seed: int, tokens_per_id: int, max_prompt: int, vocab: tuple[int, int] = (200, 49000)
) -> tuple[list[list[int]], dict]:
    """Prompts (token ids) in trace order, and facts about them (see the module docstring)."""
    rows = [json.loads(line) for line in trace.open()]
    conversations: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, row in enumerate(rows):
        conversations[tuple(row["hash_ids"][:2])].append(i)
    order = list(conversations)
    random.Random(seed).shuffle(order)
    chosen: list[int] = []
    drawn = 0
    for key in order:
        if len(chosen) >= requests:
            break
        chosen.extend(conversations[key])
        drawn += 1
    chosen.sort()
    scale = TRACE_BLOCK // tokens_per_id
    prompts = []
    for i in chosen:
        row = rows[i]
        length = min(max(round(row["input_length"] / scale), 1), max_prompt)
        tokens: list[int] = []
        for hash_id in row["hash_ids"][: -(-length // tokens_per_id)]:
            rng = random.Random(hash_id)  # one id, one block of tokens, wherever it appears
            tokens += [rng.randrange(*vocab) for _ in range(tokens_per_id)]
        prompts.append(tokens[:length])
    turns = collections.Counter(tuple(rows[i]["hash_ids"][:2]) for i in chosen)
    facts = {
        "trace": trace.name,
        "seed": seed,
        "requests": len(prompts),
        "conversations": drawn,
        "multi_turn_conversations": sum(1 for n in turns.values() if n > 1),
        "trace_rows": [chosen[0], chosen[-1]],
        "tokens_per_trace_id": tokens_per_id,
        "scale": f"1/{scale}",
        "max_prompt_tokens": max_prompt,
        "prompt_tokens": sum(map(len, prompts)),
        "prompt_tokens_median": statistics.median(map(len, prompts)),
        "prompt_tokens_max": max(map(len, prompts)),
    }
    return prompts, facts


def as_trace(prompts: list[list[int]]) -> Trace:
    """The workload as the simulator replays it (the server's block size, one output token)."""
    reqs = []
    for i, tokens in enumerate(prompts):
        keys = hash_token_blocks(tokens, BLOCK, model_id="bench")
        reqs.append(
            TraceRequest(
                tuple(keys),
                tuple(tuple(tokens[j * BLOCK : (j + 1) * BLOCK]) for j in range(len(keys))),
                len(tokens),
                1,
                float(i),
            )
        )
    return Trace(tuple(reqs), BLOCK, "mooncake-derived")


def reuse_distances(trace: Trace) -> list[int]:
    """For every lookup of a block seen before: distinct other blocks touched since its last
    use (the LRU stack distance; a pool smaller than it has evicted the block)."""
    last: dict = {}
    stream = [key for req in trace.requests for key in req.block_keys]
    out = []
    for t, key in enumerate(stream):
        if key in last:
            out.append(len(set(stream[last[key] + 1 : t])))
        last[key] = t
    return out


# ---------------------------------------------------------------------------- servers
def kv_bytes_per_token(model: str) -> int:
    """fp32 KV bytes per token of ``model`` from its config alone (no weights loaded)."""
    if model.startswith("tiny:"):
        from kvreuse.models.tiny import tiny_config

        config = tiny_config(model.removeprefix("tiny:"))
    else:
        from transformers import AutoConfig

        from kvreuse.models.loader import prepare_folder

        config = AutoConfig.from_pretrained(str(prepare_folder(model)[1]), local_files_only=True)
    return shape_from_config(config).kv_bytes_per_token("float32")


def gib_for(blocks: int, per_token: int) -> str:
    """A ``--kv-cache-memory`` / ``--host-cache-memory`` value that holds exactly ``blocks``."""
    return repr((blocks + 0.5) * BLOCK * per_token / 2**30)


def replay_once(url: dict[str, str], prompts: list[list[int]], client: httpx.Client, rep: int) -> list[dict]:
    """Every prompt in order, to both servers back to back (the order alternating)."""
    rows = []
    for i, p in enumerate(prompts):
        row = {"prompt_tokens": len(p)}
        for c in CONFIGS if (i + rep) % 2 == 0 else CONFIGS[::-1]:
            got = complete(url[c], p, client=client)
            row[c] = {"cached": got.cached_tokens, "ttft_s": round(got.seconds, 4), "by_tier": got.by_tier}
        rows.append(row)
        print(
            f"rep {rep} {i:3d} {len(p):5d} tok  device-only cached {row['device_only']['cached']:5d} "
            f"{row['device_only']['ttft_s']:7.3f} s | host tier cached {row['host_tier']['cached']:5d} "
            f"{row['host_tier']['ttft_s']:7.3f} s",
            file=sys.stderr,
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens-per-id", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--device-blocks", type=int, default=80)
    ap.add_argument("--host-gib", type=float, default=1.0)
    ap.add_argument(
        "--reps",
        type=int,
        default=1,
        help="replays of the whole workload (each from a cold cache); TTFT per request = their median",
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="30 requests, prompts of at most 512 tokens, 34 device blocks (a few minutes)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_prompt, args.device_blocks = 30, 512, 34
    out = Path(args.out or RESULTS / ("tiers_server_quick.json" if args.quick else "tiers_server.json"))

    prompts, workload = derive_workload(
        Path(args.trace),
        requests=args.requests,
        seed=args.seed,
        tokens_per_id=args.tokens_per_id,
        max_prompt=args.max_prompt,
    )
    trace = as_trace(prompts)
    per_token = kv_bytes_per_token(args.model)
    host_blocks = int(args.host_gib * 2**30) // (BLOCK * per_token)
    if args.device_blocks * BLOCK < workload["prompt_tokens_max"] + BLOCK:
        raise SystemExit(
            f"--device-blocks {args.device_blocks} cannot hold a {workload['prompt_tokens_max']}-token "
            "prompt: raise it or lower --max-prompt"
        )
    distances = reuse_distances(trace)
    sim = {
        "device_only": replay(
            trace, make_policy("priority", num_blocks=args.device_blocks), args.device_blocks
        ).hit_rate,
        "host_tier": replay(
            trace,
            make_policy("priority", num_blocks=args.device_blocks),
            args.device_blocks,
            host_blocks=host_blocks,
            host_policy=make_policy("priority", num_blocks=host_blocks),
        ).hit_rate,
        "infinite": replay(trace, make_policy("lru", num_blocks=trace.num_kv_blocks), trace.num_kv_blocks).hit_rate,
    }
    workload |= {
        "distinct_blocks": len({k for r in trace.requests for k in r.block_keys}),
        "block_reuses": len(distances),
        "reuse_distance_median_blocks": statistics.median(distances),
        "reuses_beyond_device_pool": round(sum(d >= args.device_blocks for d in distances) / len(distances), 3),
    }
    print(json.dumps(workload), file=sys.stderr)

    common = [
        "--model",
        args.model,
        "--dtype",
        "float32",
        "--quantization",
        "none",
        "--kv-cache-memory",
        gib_for(args.device_blocks, per_token),
        "--log-level",
        "warning",
    ]
    server_args = {"device_only": common, "host_tier": [*common, "--host-cache-memory", repr(args.host_gib)]}
    load_start = os.getloadavg()
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="kvreuse-tiers-server-") as tmp,
        running_servers([(free_port(), server_args[c], Path(tmp) / f"{c}.log") for c in CONFIGS]) as urls,
        httpx.Client() as client,
    ):
        url = dict(zip(CONFIGS, urls))
        for c in CONFIGS:
            info = client.get(f"{url[c]}/v1/kvreuse/info").json()
            assert info["num_blocks"] == args.device_blocks and info["block_size"] == BLOCK, info
            complete(url[c], prompts[0][:32], salt="warm-up", client=client)  # first-call costs, outside the run
        reps = []
        for rep in range(args.reps):
            for c in CONFIGS:  # every repetition starts cold: device pool and host tier emptied
                assert client.post(f"{url[c]}/reset_prefix_cache", timeout=60).status_code == 200
            reps.append(replay_once(url, prompts, client, rep))
        moved = {
            direction: {
                "blocks": metric(url["host_tier"], "kvreuse:kv_tier_blocks_moved_total", direction=direction),
                "seconds": round(
                    metric(
                        url["host_tier"],
                        "kvreuse:kv_tier_transfer_seconds_total",
                        direction=direction.replace("host_to_device", "to_device"),
                    ),
                    3,
                ),
            }
            for direction in ("device_to_host", "host_to_device")
        }
    wall = time.monotonic() - started
    for other in reps[1:]:  # the cache is deterministic: every repetition hits the same tokens
        assert [[r[c]["cached"] for c in CONFIGS] for r in other] == [
            [r[c]["cached"] for c in CONFIGS] for r in reps[0]
        ]
    rows = [
        {
            "prompt_tokens": rs[0]["prompt_tokens"],
            **{
                c: {
                    **rs[0][c],
                    "ttft_s": round(statistics.median(r[c]["ttft_s"] for r in rs), 4),
                    "ttft_s_reps": [r[c]["ttft_s"] for r in rs],
                }
                for c in CONFIGS
            },
        }
        for rs in zip(*reps)
    ]

    total = sum(r["prompt_tokens"] for r in rows)
    hit = {c: sum(r[c]["cached"] for r in rows) / total for c in CONFIGS}
    ttft = {c: [r[c]["ttft_s"] for r in rows] for c in CONFIGS}
    reuse = [r for r in rows if r["host_tier"]["cached"] > r["device_only"]["cached"]]
    by_tier = collections.Counter()
    for r in rows:
        by_tier.update(r["host_tier"]["by_tier"])
    result = {
        "model": args.model,
        "workload": workload,
        "reps": args.reps,
        "device_blocks": args.device_blocks,
        "host_blocks": host_blocks,
        "block_size": BLOCK,
        "token_hit_rate": {c: round(hit[c], 4) for c in CONFIGS},
        "hit_rate_ratio_host_vs_device_only": round(hit["host_tier"] / hit["device_only"], 2)
        if hit["device_only"]
        else None,
        "simulated_hit_rate": {k: round(v, 4) for k, v in sim.items()},
        "cached_tokens_by_tier_host_tier": dict(by_tier),
        "host_tier_copies": moved,  # from its /metrics, all repetitions: what the tier cost in copies
        "median_ttft_s": {c: round(statistics.median(ttft[c]), 4) for c in CONFIGS},
        "mean_ttft_s": {c: round(statistics.fmean(ttft[c]), 4) for c in CONFIGS},
        "p90_ttft_s": {c: round(statistics.quantiles(ttft[c], n=10)[-1], 4) for c in CONFIGS},
        "median_ttft_ratio_host_vs_device_only": round(
            statistics.median(r["host_tier"]["ttft_s"] / r["device_only"]["ttft_s"] for r in rows), 3
        ),
        "requests_the_host_tier_helped": len(reuse),
        "median_ttft_s_those_requests": {c: round(statistics.median(r[c]["ttft_s"] for r in reuse), 4) for c in CONFIGS}
        if reuse
        else None,
        "total_ttft_s": {c: round(sum(ttft[c]), 2) for c in CONFIGS},
        "wall_s": round(wall, 1),
        "load_average_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
        "per_request": rows,
        "command": "python bench/tiers/tiers_server.py " + " ".join(sys.argv[1:]),
    }
    write_json(out, result, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "per_request"}, indent=2))
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = ["device only", "+ host tier", "simulated\ndevice only", "simulated\n+ host tier", "infinite"]
    values = [
        result["token_hit_rate"]["device_only"],
        result["token_hit_rate"]["host_tier"],
        result["simulated_hit_rate"]["device_only"],
        result["simulated_hit_rate"]["host_tier"],
        result["simulated_hit_rate"]["infinite"],
    ]
    bars = left.bar(names, [100 * v for v in values], color=["#c55", "#49c", "#e99", "#9bd", "#999"])
    for bar, v in zip(bars, values):
        left.annotate(
            f"{100 * v:.1f}%",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    left.set_ylabel("token hit rate (%)")
    left.tick_params(axis="x", labelsize=8)
    left.set_title(f"{result['device_blocks']} device blocks, host tier {result['host_blocks']} blocks", fontsize=9)
    for c, colour, label in (("device_only", "#c55", "device only"), ("host_tier", "#49c", "+ host tier")):
        xs = sorted(r[c]["ttft_s"] for r in result["per_request"])
        right.plot(
            xs,
            [(i + 1) / len(xs) for i in range(len(xs))],
            color=colour,
            label=f"{label} (median {result['median_ttft_s'][c]:.3f} s)",
        )
    right.set_xscale("log")
    right.set_xlabel("TTFT (s, log scale)")
    right.set_ylabel("fraction of requests")
    right.grid(alpha=0.3)
    right.legend(fontsize=8)
    w = result["workload"]
    fig.suptitle(
        f"{result['model']}: {w['requests']} requests of a Mooncake-derived workload (seed {w['seed']}, "
        f"{w['scale']} scale) through kvreuse serve",
        fontsize=9,
    )
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
