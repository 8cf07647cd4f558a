"""End-to-end part of the retention benchmark: the same workload through two real
``kvreuse serve`` processes on the default model, one evicting by LRU and one by
TensorRT-LLM priority, with the same KV memory, requests interleaved between them.

    .venv/bin/python bench/eviction/retention_e2e.py [--requests 24] [--kv-blocks 40]

Each request = one of 4 shared system prompts (priority 90 for 60 s) + a unique question,
then ``--max-tokens`` generated tokens (decode priority 10, ``ignore_eos``). Hit rate =
sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of prompt tokens, as reported
by the servers. Writes bench/results/retention_e2e.{json,png}.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, environment, free_port, pyplot, running_servers, save_png, write_json

BYTES_PER_TOKEN = 46080  # SmolLM2-135M fp32: 2 * 30 layers * 3 kv heads * 64 * 4 bytes
BLOCK = 16


def server_args(policy: str, kv_blocks: int) -> list[str]:
    """``kvreuse serve`` arguments for one side: fp32 (``BYTES_PER_TOKEN`` is fp32's), a pool of
    ``kv_blocks`` blocks, eviction by ``policy``, one sequence at a time."""
    gib = kv_blocks * BLOCK * BYTES_PER_TOKEN / 2**30
    return [
        "--dtype",
        "float32",
        "--quantization",
        "none",
        "--kv-cache-memory",
        f"{gib:.9f}",
        "--eviction-policy",
        policy,
        "--max-num-seqs",
        "1",
        "--log-level",
        "warning",
    ]


def workload(n: int, system_tokens: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    systems = [[rng.randrange(1000, 20000) for _ in range(system_tokens)] for _ in range(4)]
    out = []
    for _ in range(n):
        system = systems[rng.randrange(4)]
        question = [rng.randrange(20000, 40000) for _ in range(rng.randint(8, 24))]
        out.append({"prompt": system + question, "system_tokens": len(system)})
    return out


def send(client: httpx.Client, url: str, model: str, req: dict, max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": req["prompt"],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "kv_cache_retention_config": {
            "token_range_retention_configs": [
                {"token_start": 0, "token_end": req["system_tokens"], "priority": 90, "duration_ms": 60000}
            ],
            "decode_retention_priority": 10,
        },
    }
    r = client.post(url + "/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    return r.json()["usage"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--kv-blocks", type=int, default=40, help="pool size of each server, in 16-token blocks")
    ap.add_argument("--system-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160)
    args = ap.parse_args()
    policies = ("lru", "priority")
    with (
        tempfile.TemporaryDirectory() as logs,
        environment(OMP_NUM_THREADS="1"),
        running_servers(
            [(free_port(), server_args(p, args.kv_blocks), Path(logs) / f"{p}.log") for p in policies], startup_s=300
        ) as urls,
    ):
        servers = dict(zip(policies, urls))
        reqs = workload(args.requests, args.system_tokens)
        tally = {p: {"prompt_tokens": 0, "cached_tokens": 0, "per_request": []} for p in servers}
        with httpx.Client() as client:
            model = client.get(servers["lru"] + "/v1/models").json()["data"][0]["id"]
            for i, req in enumerate(reqs):
                for policy, url in servers.items():  # interleaved: same order, same moment
                    usage = send(client, url, model, req, args.max_tokens)
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    t = tally[policy]
                    t["prompt_tokens"] += usage["prompt_tokens"]
                    t["cached_tokens"] += cached
                    t["per_request"].append(cached)
                print(
                    f"request {i}: " + ", ".join(f"{p} cached {tally[p]['per_request'][-1]}" for p in servers),
                    flush=True,
                )
    for t in tally.values():
        t["hit_rate"] = t["cached_tokens"] / t["prompt_tokens"]
    gain = tally["priority"]["hit_rate"] / tally["lru"]["hit_rate"] - 1 if tally["lru"]["hit_rate"] else None
    doc = {
        "model": "SmolLM2-135M-Instruct (default), fp32, CPU",
        "kv_blocks_per_server": args.kv_blocks,
        "block_size": BLOCK,
        "requests": args.requests,
        "system_tokens": args.system_tokens,
        "max_tokens": args.max_tokens,
        "policies": tally,
        "priority_vs_lru_gain": gain,
    }
    write_json(RESULTS / "retention_e2e.json", doc)
    plot(tally, RESULTS / "retention_e2e.png", args)
    for p, t in tally.items():
        print(f"{p:<9} hit rate {t['hit_rate']:.3f} ({t['cached_tokens']}/{t['prompt_tokens']} prompt tokens)")
    print(f"priority vs LRU through the server: {gain:+.1%} cache hits" if gain is not None else "LRU had no hits")


def plot(tally: dict, path: Path, args: argparse.Namespace) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4))
    for policy, t in tally.items():
        cum, acc = [], 0
        for c in t["per_request"]:
            acc += c
            cum.append(acc)
        ax.plot(range(1, len(cum) + 1), cum, marker="o", label=f"{policy} (hit rate {t['hit_rate']:.2f})")
    ax.set_xlabel("request")
    ax.set_ylabel("cumulative cached prompt tokens")
    ax.set_title(f"kvreuse serve, default model, {args.kv_blocks} x 16-token blocks per server")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
