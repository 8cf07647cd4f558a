"""End-to-end part of the retention benchmark: the same workload through two real
``kvreuse serve`` processes on the default model, one evicting by LRU and one by
TensorRT-LLM priority, with the same KV memory, requests interleaved between them.

    .venv/bin/python bench/retention_e2e.py [--requests 24] [--kv-blocks 40]

Each request = one of 4 shared system prompts (priority 90 for 60 s) + a unique question,
then ``--max-tokens`` generated tokens (decode priority 10, ``ignore_eos``). Hit rate =
sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of prompt tokens, as reported
by the servers. Writes bench/results/retention_e2e.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
BYTES_PER_TOKEN = 46080  # SmolLM2-135M fp32: 2 * 30 layers * 3 kv heads * 64 * 4 bytes
BLOCK = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(policy: str, kv_blocks: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    gib = kv_blocks * BLOCK * BYTES_PER_TOKEN / 2**30
    cmd = [sys.executable, "-m", "kvreuse", "serve", "--dtype", "float32", "--quantization", "none",  # BYTES_PER_TOKEN is fp32's
           "--port", str(port), "--kv-cache-memory", f"{gib:.9f}",
           "--eviction-policy", policy, "--max-num-seqs", "1", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server ({policy}) exited: {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server ({policy}) did not start in 300 s")


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
    servers = {p: start_server(p, args.kv_blocks) for p in ("lru", "priority")}
    try:
        reqs = workload(args.requests, args.system_tokens)
        tally = {p: {"prompt_tokens": 0, "cached_tokens": 0, "per_request": []} for p in servers}
        with httpx.Client() as client:
            model = client.get(servers["lru"][1] + "/v1/models").json()["data"][0]["id"]
            for i, req in enumerate(reqs):
                for policy, (_, url) in servers.items():  # interleaved: same order, same moment
                    usage = send(client, url, model, req, args.max_tokens)
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    t = tally[policy]
                    t["prompt_tokens"] += usage["prompt_tokens"]
                    t["cached_tokens"] += cached
                    t["per_request"].append(cached)
                print(f"request {i}: " + ", ".join(f"{p} cached {tally[p]['per_request'][-1]}" for p in servers),
                      flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
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
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "retention_e2e.json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(tally, RESULTS / "retention_e2e.png", args)
    for p, t in tally.items():
        print(f"{p:<9} hit rate {t['hit_rate']:.3f} ({t['cached_tokens']}/{t['prompt_tokens']} prompt tokens)")
    print(f"priority vs LRU through the server: {gain:+.1%} cache hits" if gain is not None else "LRU had no hits")


def plot(tally: dict, path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
