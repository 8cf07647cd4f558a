"""Live router benchmark: median TTFT through ``kv`` vs ``round_robin`` routing, one run.

    .venv/bin/python bench/router/router.py [--model default] [--users 4] [--kv-cache-memory 0.09]

For each policy: two fresh ``kvreuse serve`` executors of the model, a ``kvreuse route``
in front, then the same workload: 8 system prompts (~470 tokens each) x ``--users``
users, in a seeded random order, sent by 2 concurrent streaming clients. Each executor's
KV pool holds about half of the system prompts, so where a prompt is sent decides whether
it is a hit: kv routing keeps each system prompt on one executor; round robin sends every
prompt to both and they evict each other. TTFT is the client's time to the first streamed
chunk with content. Writes bench/results/router.json and bench/results/router.png.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import executor, free_port, pyplot, router, save_png, wait_healthy, write_json

RULES = 16  # ~470 tokens per system prompt with the SmolLM2 tokenizer
TOPICS = ["astronomy", "botany", "chemistry", "databases", "economics", "finance", "geology", "history"]


def system_prompt(topic: str) -> str:
    rules = " ".join(
        f"Rule {i} for the {topic} assistant: answer precisely, cite the {topic} handbook section {i}, "
        f"and never speculate beyond it."
        for i in range(RULES)
    )
    return f"You are an expert {topic} assistant. {rules}"


def ttft(url: str, messages: list[dict]) -> tuple[float, int, str]:
    body = {
        "messages": messages,
        "max_tokens": 4,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    cached = 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        where = r.headers.get("x-kvreuse-executor", "")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return (first if first is not None else time.perf_counter() - start), cached, where


def run_policy(policy: str, args, workload, logs: str) -> dict:
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [
        executor(p, logs, args.model, kv_cache_memory=args.kv_cache_memory, max_model_len=2048).start() for p in ports
    ]
    rport = free_port()
    rt = router(rport, urls, logs, "--routing-policy", policy, "--seed", "0").start()
    url = f"http://127.0.0.1:{rport}"
    try:
        wait_healthy(url, [*procs, rt], timeout=600, all_of=2)
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda m: ttft(url, m), workload))
    finally:
        for p in [rt, *procs]:
            p.stop()
    times = [r[0] for r in results]
    return {
        "policy": policy,
        "requests": len(results),
        "ttft_median_s": statistics.median(times),
        "ttft_p90_s": sorted(times)[int(0.9 * (len(times) - 1))],
        "ttft_mean_s": statistics.mean(times),
        "hit_requests": sum(1 for r in results if r[1] > 0),
        "cached_tokens_mean": statistics.mean(r[1] for r in results),
        "requests_per_executor": {u: sum(1 for r in results if r[2] == u) for u in urls},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=float, default=0.09, help="GiB per executor (about 4 system prompts)")
    ap.add_argument("--out", default="bench/results/router.json")
    args = ap.parse_args()
    rng = random.Random(0)
    workload = [
        [
            {"role": "system", "content": system_prompt(t)},
            {"role": "user", "content": f"User {u}: question {u} on {t}?"},
        ]
        for t in TOPICS
        for u in range(args.users)
    ]
    rng.shuffle(workload)
    logs = tempfile.mkdtemp(prefix="router-bench-")
    results = [run_policy(p, args, workload, logs) for p in ("kv", "round_robin")]
    kv, rr = results
    doc = {
        "model": args.model,
        "system_prompts": len(TOPICS),
        "users": args.users,
        "concurrency": args.concurrency,
        "kv_cache_memory_gib": args.kv_cache_memory,
        "results": results,
        "speedup_median_ttft": rr["ttft_median_s"] / kv["ttft_median_s"],
        "command": "python bench/router/router.py " + " ".join(sys.argv[1:]),
        "logs": logs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), doc)
    plot(doc, Path(args.out).with_suffix(".png"))
    print(json.dumps(doc, indent=2))


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()

    names = [r["policy"] for r in doc["results"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    med = [r["ttft_median_s"] * 1e3 for r in doc["results"]]
    p90 = [r["ttft_p90_s"] * 1e3 for r in doc["results"]]
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], med, width=0.4, label="median")
    ax.bar([i + 0.2 for i in x], p90, width=0.4, label="p90")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(
        f"{doc['model']}: 2 executors, {doc['system_prompts']} system prompts x {doc['users']} users\n"
        f"median TTFT {doc['speedup_median_ttft']:.1f}x lower with kv routing"
    )
    ax.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=110)


if __name__ == "__main__":
    main()
