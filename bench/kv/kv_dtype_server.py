"""int8 KV against bf16 KV at the same memory, through real ``kvreuse serve`` processes: the
Mooncake-derived workload of ``bench/tiers/tiers_server.py`` (its ``derive_workload``: whole
conversations of the shipped trace, 512 trace tokens -> 16 served tokens), hit rate and TTFT
(issue 34: "int8 KV hit rate >= 1.6x bf16's and p50 TTFT lower"), the simulator's figure beside.

    PYTHONPATH=src .venv/bin/python bench/kv/kv_dtype_server.py [--requests 60] [--bf16-blocks 80] [--tag _NAME]
    -> bench/results/kv_dtype_server<tag>.{json,png}

Two servers of the default model at the serving defaults (int4 weights, bf16 activations), the
same ``--kv-cache-memory``: the bytes of ``--bf16-blocks`` bf16 blocks (under pressure: the
workload's reuse distances run past it); one keeps bf16 K/V, one ``--kv-cache-dtype int8`` (its
pool holds ~1.9x the blocks in those bytes). Requests one at a time in trace order, each to both
servers back to back (order alternating), ``max_tokens`` 1 (the call's latency is its TTFT).
Hit rate = sum of ``cached_tokens`` / sum of prompt tokens. Beside it, the simulator's replay of
the same workload at each server's block count (from ``/v1/kvreuse/info``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, TRACE, free_port, machine, pyplot, running_servers, save_png, write_json
from bench.tiers.tiers_server import BLOCK, as_trace, derive_workload
from kvreuse.cache.eviction import make_policy
from kvreuse.simulator.replay import replay
from tests.serve_client import complete

ARMS = ("bfloat16", "int8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--bf16-blocks", type=int, default=80, help="the memory of this many bf16 blocks, both servers")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    prompts, workload = derive_workload(
        Path(TRACE), requests=args.requests, seed=args.seed, tokens_per_id=BLOCK, max_prompt=args.max_prompt
    )
    trace = as_trace(prompts)
    bf16_per_token = 23_040 if args.model == "default" else None  # SmolLM2-135M: 30 layers x 2 x 3 heads x 64 x 2 B
    if bf16_per_token is None:
        raise SystemExit("--model: only the default model's bytes per token are known here")
    gib = repr((args.bf16_blocks + 0.5) * BLOCK * bf16_per_token / 2**30)
    common = ["--model", args.model, "--kv-cache-memory", gib, "--log-level", "warning"]
    server_args = {"bfloat16": [*common, "--kv-cache-dtype", "bfloat16"], "int8": [*common, "--kv-cache-dtype", "int8"]}
    started = time.monotonic()
    rows: list[dict] = []
    with (
        tempfile.TemporaryDirectory(prefix="kvreuse-kv-dtype-") as tmp,
        running_servers([(free_port(), server_args[a], Path(tmp) / f"{a}.log") for a in ARMS]) as urls,
        httpx.Client() as client,
    ):
        url = dict(zip(ARMS, urls))
        blocks = {a: client.get(f"{url[a]}/v1/kvreuse/info").json()["num_blocks"] for a in ARMS}
        for a in ARMS:
            complete(url[a], prompts[0][:32], salt="warm-up", client=client)  # first-call costs, outside the run
            assert client.post(f"{url[a]}/reset_prefix_cache", timeout=60).status_code == 200
        for i, p in enumerate(prompts):
            row: dict = {"prompt_tokens": len(p)}
            for a in ARMS if i % 2 == 0 else ARMS[::-1]:
                got = complete(url[a], p, client=client)
                row[a] = {"cached": got.cached_tokens, "ttft_s": round(got.seconds, 4)}
            rows.append(row)
            print(
                f"{i:3d} {len(p):5d} tok  bf16 cached {row['bfloat16']['cached']:5d} {row['bfloat16']['ttft_s']:6.3f} s"
                f" | int8 cached {row['int8']['cached']:5d} {row['int8']['ttft_s']:6.3f} s",
                file=sys.stderr,
            )
    total = sum(r["prompt_tokens"] for r in rows)
    served = {
        a: {
            "num_blocks": blocks[a],
            "hit_rate": sum(r[a]["cached"] for r in rows) / total,
            "ttft_p50_s": statistics.median(r[a]["ttft_s"] for r in rows),
            "ttft_mean_s": statistics.mean(r[a]["ttft_s"] for r in rows),
            "simulated_hit_rate": replay(trace, make_policy("priority", num_blocks=blocks[a]), blocks[a]).hit_rate,
        }
        for a in ARMS
    }
    ratio = {
        "hit_rate": served["int8"]["hit_rate"] / served["bfloat16"]["hit_rate"],
        "ttft_p50": served["int8"]["ttft_p50_s"] / served["bfloat16"]["ttft_p50_s"],
    }
    for a in ARMS:
        s = served[a]
        print(
            f"{a:>8}: {s['num_blocks']} blocks, hit {s['hit_rate']:.3f} (simulator {s['simulated_hit_rate']:.3f}), "
            f"TTFT p50 {s['ttft_p50_s'] * 1e3:.0f} ms"
        )
    print(f"int8 / bf16: hit rate x{ratio['hit_rate']:.2f}, TTFT p50 x{ratio['ttft_p50']:.2f}")
    out = RESULTS / f"kv_dtype_server{args.tag}.json"
    write_json(
        out,
        {
            "machine": machine(),
            "args": vars(args),
            "kv_cache_memory_gib": float(gib),
            "workload": workload,
            "served": served,
            "int8_over_bf16": ratio,
            "rows": rows,
            "minutes": (time.monotonic() - started) / 60,
        },
    )
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(list(ARMS), [served[a]["hit_rate"] for a in ARMS], label="served")
    axes[0].scatter(list(ARMS), [served[a]["simulated_hit_rate"] for a in ARMS], color="k", zorder=3, label="simulator")
    axes[0].set_title(f"token hit rate at {float(gib) * 1024:.1f} MiB of KV")
    axes[0].legend()
    for a in ARMS:
        axes[1].plot(sorted(r[a]["ttft_s"] * 1e3 for r in rows), label=a)
    axes[1].set_title("TTFT per request, sorted (ms)")
    axes[1].legend()
    save_png(fig, out.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
