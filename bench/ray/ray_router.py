"""KV-aware request routing on Ray Serve: prefix-cache hit rate of ``kvreuse ray``'s request
router against Ray Serve's default power-of-two router and against ``kvreuse route``.

    PYTHONPATH=src .venv/bin/python bench/ray/ray_router.py [--model default] [--requests 60]
        [--device-blocks 96] [--concurrency 2] [--arms kv,pow2,route]

The workload is ``bench/tiers/tiers_server.py``'s Mooncake-derived one (the shipped
conversation trace, conversations drawn with ``--seed``, each trace hash id one 16-token
block of seeded random ids, prompts of at most ``--max-prompt`` tokens, ``max_tokens`` 1),
sent in trace order by ``--concurrency`` clients. Three arms, each from cold caches, each
with two replicas of ``--model`` whose device pools hold ``--device-blocks`` blocks each:

- ``kv``: ``kvreuse ray --replicas 2`` (kvreuse's index and ``kv`` policy pick the replica);
- ``pow2``: ``kvreuse ray --replicas 2 --request-router pow2`` (Ray's
  ``PowerOfTwoChoicesRequestRouter`` picks it);
- ``route``: two ``kvreuse serve`` processes behind ``kvreuse route`` (the same flags).

Hit rate = cached prompt tokens / prompt tokens (``usage.prompt_tokens_details``), over the
whole run. Also the simulator's bound: one pool as large as both (every block anywhere).
Writes bench/results/ray_router.json and .png.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, TRACE, pyplot, save_png, write_json
from bench.tiers.tiers_server import as_trace, derive_workload, gib_for, kv_bytes_per_token
from tests.ray_serve.ray_app import running_ray_app
from tests.router.cluster import Proc, free_port, router, wait_healthy

ARMS = ("kv", "pow2", "route")


def send(url: str, prompt: list[int], client: httpx.Client) -> dict:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    r = client.post(f"{url}/v1/completions", json=body, timeout=600)
    seconds = time.perf_counter() - started
    if r.status_code != 200:
        return {"prompt_tokens": len(prompt), "cached": 0, "error": f"{r.status_code}: {r.text[:200]}"}
    usage = r.json()["usage"]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "executor": r.headers.get("x-kvreuse-executor"),
        "seconds": round(seconds, 4),
    }


def replay(url: str, prompts: list[list[int]], concurrency: int) -> list[dict]:
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        rows = list(pool.map(lambda p: send(url, p, client), prompts))
    return rows


def summary(arm: str, rows: list[dict], wall_s: float) -> dict:
    prompt = sum(r["prompt_tokens"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    per_executor: dict[str, int] = {}
    for r in rows:
        if r.get("executor"):
            per_executor[r["executor"]] = per_executor.get(r["executor"], 0) + 1
    return {
        "arm": arm,
        "requests": len(rows),
        "errors": [r["error"] for r in rows if "error" in r],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": round(cached / prompt, 4),
        "requests_per_executor_as_the_router_saw_it": per_executor,
        "wall_s": round(wall_s, 1),
    }


def run_ray(arm: str, serve_flags: list[str], prompts: list[list[int]], args, logs: Path) -> dict:
    flags = [*serve_flags, "--num-cpus", "4", "--replica-cpus", "1", "--router-seed", "0"]
    if arm == "pow2":
        flags += ["--request-router", "pow2"]
    with running_ray_app(2, flags, logs / f"ray-{arm}.log") as (url, _):
        started = time.monotonic()
        rows = replay(url, prompts, args.concurrency)
        return summary(arm, rows, time.monotonic() - started)


def run_route(serve_flags: list[str], prompts: list[list[int]], args, logs: Path) -> dict:
    ports = [free_port(), free_port()]
    flags = [*serve_flags, "--event-buffer-max-size", "100000", "--log-level", "warning"]
    procs = [Proc(["serve", "--port", str(p), *flags], f"{logs}/executor-{p}.log").start() for p in ports]
    rport = free_port()
    rt = router(rport, [f"http://127.0.0.1:{p}" for p in ports], str(logs), "--seed", "0").start()
    url = f"http://127.0.0.1:{rport}"
    try:
        wait_healthy(url, [*procs, rt], timeout=900, all_of=2)
        started = time.monotonic()
        rows = replay(url, prompts, args.concurrency)
        return summary("route", rows, time.monotonic() - started)
    finally:
        for p in [rt, *procs]:
            p.stop()


class RandomPolicy:
    """Any executor, at random: what power of two choices does between two idle replicas."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def scores(self, candidates, *, dry_run: bool = False) -> list[float]:
        return [self.rng.random() for _ in candidates]


def simulated_routing(trace, blocks: int) -> dict[str, float]:
    """Hit rates of the same workload across two simulated pools of ``blocks`` each
    (``kvreuse.router.simulation``: real pools and index, a perfectly fresh index), routed
    by the ``kv`` policy and at random, and with pools that never evict (the routing's bound)."""
    from kvreuse.router.policy import make_policy as make_routing_policy
    from kvreuse.router.simulation import simulate_routed

    out = {}
    for capacity, suffix in ((blocks, ""), (trace.num_kv_blocks, "_infinite_pools")):
        for name, policy in (("kv", make_routing_policy("kv")), ("random", RandomPolicy())):
            out[name + suffix] = round(
                simulate_routed(trace, policy, executors=2, capacity_blocks=capacity).hit_rate, 4
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens-per-id", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=1024)
    ap.add_argument("--device-blocks", type=int, default=96, help="KV blocks per replica")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out", default=str(RESULTS / "ray_router.json"))
    args = ap.parse_args()
    prompts, workload = derive_workload(
        TRACE, requests=args.requests, seed=args.seed, tokens_per_id=args.tokens_per_id, max_prompt=args.max_prompt
    )
    per_token = kv_bytes_per_token(args.model)
    serve_flags = ["--model", args.model, "--dtype", "float32", "--quantization", "none"]
    serve_flags += ["--kv-cache-memory", gib_for(args.device_blocks, per_token), "--max-model-len", "2048"]
    from kvreuse.cache.eviction import make_policy
    from kvreuse.simulator.replay import replay as simulate

    trace = as_trace(prompts)
    both = 2 * args.device_blocks
    bound = simulate(trace, make_policy("priority", num_blocks=both), both).hit_rate
    simulated = simulated_routing(trace, args.device_blocks)
    print(json.dumps({"simulated_routing": simulated, "one_pool_of_both": bound}), file=sys.stderr)
    logs = Path(tempfile.mkdtemp(prefix="ray-router-bench-"))
    results = {}
    for arm in args.arms.split(","):
        print(f"arm {arm} ...", file=sys.stderr)
        if arm == "route":
            results[arm] = run_route(serve_flags, prompts, args, logs)
        else:
            results[arm] = run_ray(arm, serve_flags, prompts, args, logs)
        print(json.dumps(results[arm]), file=sys.stderr)
    ratios = {}
    if "kv" in results and "pow2" in results and results["pow2"]["hit_rate"]:
        ratios["kv_over_pow2"] = round(results["kv"]["hit_rate"] / results["pow2"]["hit_rate"], 3)
    if "kv" in results and "route" in results and results["route"]["hit_rate"]:
        ratios["kv_over_route"] = round(results["kv"]["hit_rate"] / results["route"]["hit_rate"], 3)
    doc = {
        "model": args.model,
        "workload": workload,
        "replicas": 2,
        "device_blocks_per_replica": args.device_blocks,
        "concurrency": args.concurrency,
        "simulated_one_pool_of_both": round(bound, 4),
        "simulated_routing": simulated,
        "results": results,
        "ratios": ratios,
        "command": "PYTHONPATH=src .venv/bin/python bench/ray/ray_router.py " + " ".join(sys.argv[1:]),
        "logs": str(logs),
    }
    out = Path(args.out)
    write_json(out, doc)
    plot(doc, out.with_suffix(".png"))
    print(json.dumps({"results": {k: v["hit_rate"] for k, v in results.items()}, "ratios": ratios}))


def plot(doc: dict, path: Path) -> None:
    plt = pyplot()
    names = list(doc["results"])
    rates = [doc["results"][n]["hit_rate"] for n in names]
    labels = {
        "kv": "kvreuse ray\n(KV request router)",
        "pow2": "kvreuse ray\n(Ray power of two)",
        "route": "kvreuse route",
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([labels.get(n, n) for n in names], rates, color=["tab:green", "tab:gray", "tab:blue"][: len(names)])
    ax.axhline(doc["simulated_one_pool_of_both"], color="k", linestyle=":", label="one pool of both (simulated)")
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in doc["ratios"].items())
    ax.set_title(
        f"{doc['model']}: 2 replicas x {doc['device_blocks_per_replica']} blocks, "
        f"{doc['workload']['requests']} Mooncake-derived requests\n{ratios}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


if __name__ == "__main__":
    main()
