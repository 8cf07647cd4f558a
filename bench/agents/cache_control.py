"""Agents through Anthropic's API: ``cache_control`` honoured as retention vs stripped (what every
peer does), the same requests interleaved between two ``kvreuse serve`` processes with the same
small KV pool.

    PYTHONPATH=src .venv/bin/python bench/agents/cache_control.py [--model tiny:llama] [--agents 4]
        [--steps 8] [--rag 6] [--kv-blocks 360] [--tag _NAME]

The workload (docs/anthropic.md): ``--agents`` agents interleaved, each with its own long system
prompt (its tools described in it; a 1h breakpoint) and a tool-loop history that grows by one
tool result and one reply per step, the 5m breakpoint moving to the newest turn each step; after
every round of agent steps, ``--rag`` one-off RAG requests (a unique document and a question,
no cache_control) flood the pool. Every request generates 1 token, so its latency is its TTFT
(prefill + one step).

Per side, over the agents' requests: hit rate = sum of ``cache_read_input_tokens`` / sum of
prompt tokens (read + creation + input), and TTFT p50 / p95. The stripped side sends the same
bodies with every ``cache_control`` removed. Writes bench/results/agents_cache_control.{json,png}.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, environment, free_port, pyplot, running_servers, save_png, write_json

BLOCK = 16
BYTES_PER_TOKEN = {"tiny:llama": 512, "default": 46080}  # K and V, all layers, fp32
HOUR, FIVE = {"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral"}


def words(rng: random.Random, n: int, tag: str) -> str:
    return " ".join(f"{tag}{rng.randrange(10_000)}" for _ in range(n))


def agent_requests(agents: int, steps: int, rag: int, system_words: int, seed: int = 0) -> list[dict]:
    """The request bodies in the order they are sent, each tagged ``kind`` (agent / rag)."""
    rng = random.Random(seed)
    systems = [f"You are agent {a}. Tools: " + words(rng, system_words, f"tool{a}_") for a in range(agents)]
    histories: list[list[dict]] = [[] for _ in range(agents)]
    out = []
    for step in range(steps):
        for a in range(agents):
            history = histories[a]
            if history:  # the last step's reply, then this step's tool result
                history.append({"role": "assistant", "content": words(rng, 6, f"reply{a}_")})
            history.append({"role": "user", "content": f"tool result {step}: " + words(rng, 16, f"res{a}_")})
            messages = copy.deepcopy(history)
            messages[-1]["content"] = [{"type": "text", "text": messages[-1]["content"], "cache_control": FIVE}]
            body = {
                "max_tokens": 1,
                "temperature": 0,
                "messages": messages,
                "system": [{"type": "text", "text": systems[a], "cache_control": HOUR}],
            }
            out.append({"kind": "agent", "agent": a, "body": body})
        for _ in range(rag):
            doc = words(rng, 100, "doc")  # ~500 tokens
            out.append(
                {
                    "kind": "rag",
                    "body": {
                        "max_tokens": 1,
                        "temperature": 0,
                        "messages": [{"role": "user", "content": f"Document: {doc}\n\nWhat does it say?"}],
                    },
                }
            )
    return out


def stripped(body: dict) -> dict:
    """``body`` with every ``cache_control`` removed (what a server that ignores them sees)."""
    if isinstance(body, dict):
        return {k: stripped(v) for k, v in body.items() if k != "cache_control"}
    if isinstance(body, list):
        return [stripped(v) for v in body]
    return body


def server_args(model: str, kv_blocks: int) -> list[str]:
    gib = kv_blocks * BLOCK * BYTES_PER_TOKEN[model] / 2**30
    return [
        "--model",
        model,
        "--dtype",
        "float32",
        "--quantization",
        "none",
        "--kv-cache-memory",
        f"{gib:.9f}",
        "--max-num-seqs",
        "1",
        "--served-model-name",
        "m",
        "--log-level",
        "warning",
    ]


def send(client: httpx.Client, url: str, body: dict) -> tuple[dict, float]:
    start = time.perf_counter()
    r = client.post(url + "/v1/messages", json={"model": "m", **body}, timeout=600)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    return r.json()["usage"], elapsed


def summary(samples: list[tuple[dict, float]]) -> dict:
    prompt = sum(
        u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] for u, _ in samples
    )
    read = sum(u["cache_read_input_tokens"] for u, _ in samples)
    ttft = sorted(t for _, t in samples)
    p95 = ttft[min(len(ttft) - 1, round(0.95 * (len(ttft) - 1)))]
    return {
        "requests": len(samples),
        "prompt_tokens": prompt,
        "cache_read_tokens": read,
        "hit_rate": read / prompt if prompt else 0.0,
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_p95_ms": p95 * 1e3,
        "ttft_ms": [t * 1e3 for _, t in samples],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny:llama", choices=sorted(BYTES_PER_TOKEN))
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rag", type=int, default=6, help="one-off RAG requests after each round of agent steps")
    ap.add_argument("--system-words", type=int, default=40, help="~7 tokens each")
    # the agents' final working set is ~310 blocks: it fits, but not with a round's RAG flood (~190) on top
    ap.add_argument("--kv-blocks", type=int, default=360, help="pool size of each server, in 16-token blocks")
    ap.add_argument("--tag", default="", help="results go to agents_cache_control[_TAG].json/png")
    args = ap.parse_args()
    sides = ("honoured", "stripped")
    requests = agent_requests(args.agents, args.steps, args.rag, args.system_words)
    with (
        tempfile.TemporaryDirectory() as logs,
        environment(OMP_NUM_THREADS="1"),
        running_servers(
            [(free_port(), server_args(args.model, args.kv_blocks), Path(logs) / f"{s}.log") for s in sides],
            startup_s=300,
        ) as urls,
    ):
        servers = dict(zip(sides, urls))
        samples: dict[str, list[tuple[dict, float]]] = {s: [] for s in sides}
        with httpx.Client() as client:
            for i, req in enumerate(requests):
                order = sides if i % 2 == 0 else sides[::-1]  # interleaved, alternating who goes first
                for side in order:
                    body = req["body"] if side == "honoured" else stripped(req["body"])
                    usage, elapsed = send(client, servers[side], body)
                    if req["kind"] == "agent":
                        samples[side].append((usage, elapsed))
    result = {s: summary(samples[s]) for s in sides}
    h, st = result["honoured"], result["stripped"]
    doc = {
        "model": f"{args.model}, fp32, CPU",
        "kv_blocks_per_server": args.kv_blocks,
        "block_size": BLOCK,
        "agents": args.agents,
        "steps": args.steps,
        "rag_per_round": args.rag,
        "sides": result,
        "hit_rate_ratio": h["hit_rate"] / st["hit_rate"] if st["hit_rate"] else None,
        "ttft_p50_ratio": h["ttft_p50_ms"] / st["ttft_p50_ms"],
        "ttft_p95_ratio": h["ttft_p95_ms"] / st["ttft_p95_ms"],
    }
    write_json(RESULTS / f"agents_cache_control{args.tag}.json", doc)
    plot(result, RESULTS / f"agents_cache_control{args.tag}.png", args)
    for side, r in result.items():
        print(
            f"{side:<9} hit rate {r['hit_rate']:.3f}  TTFT p50 {r['ttft_p50_ms']:.1f} ms  p95 {r['ttft_p95_ms']:.1f} ms"
        )
    ratio = doc["hit_rate_ratio"]
    print(
        f"honoured / stripped: hit rate x{ratio:.2f}" if ratio else "stripped had no hits",
        f" TTFT p50 x{doc['ttft_p50_ratio']:.2f}, p95 x{doc['ttft_p95_ratio']:.2f}",
    )


def plot(result: dict, path: Path, args: argparse.Namespace) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for side, r in result.items():
        right.plot(range(1, len(r["ttft_ms"]) + 1), r["ttft_ms"], marker=".", label=side)
    left.bar(list(result), [r["hit_rate"] for r in result.values()], color=["tab:green", "tab:gray"])
    left.set_ylabel("agents' prompt tokens read from cache")
    left.set_title("hit rate")
    right.set_xlabel("agent request")
    right.set_ylabel("TTFT (ms)")
    right.set_title(f"{args.agents} agents, {args.rag} RAG floods per round, {args.kv_blocks} blocks")
    right.legend()
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
