"""Two executors on one Redis, a Redis crash under load, a restart from disk, a corrupted
block file and tenant isolation, all through real ``kvreuse serve`` processes of the
default model and a real ``redis-server`` this script starts on a free loopback port.

    .venv/bin/python bench/tiers/tiers_cluster.py [--model default] [--prompt 2048] [--load 40]

Executors A (host tier + disk tier + Redis) and B (host tier + Redis), each with a small
device pool. In order:

1. sharing: a ``--prompt``-token prompt computed on A (written through to disk and Redis);
   B asked the same prompt under another ``cache_salt`` computes it itself (and must find
   none of A's blocks: isolation); B asked without a salt reports ``cached_tokens`` >= prompt
   - one block, all from Redis, and the same greedy text; A asked under B's salt finds B's
   chain in Redis (a tenant shares across executors) and none of its own unsalted blocks.
2. Redis killed (SIGKILL) after half of a ``--load``-request load (4 at a time, A and B
   alternating; B asks prompts A computed a few requests before, so sharing is live): every
   request must succeed; then Redis is started again (empty, same port) and, once the
   breakers' cool-down has passed, a new prompt computed on A is a remote hit on B.
3. restart: A is stopped (a graceful stop finishes its queued writes) and started again
   with the same flags: the first repeat of the prompt reports >= prompt - one block, from
   its disk, with the same greedy text.
4. corruption: A stopped, the middle block file of the prompt's chain flipped, A started:
   the file is refused (a log line, ``kvreuse:disk_tier_events_total{event="corrupt"}``),
   the blocks before it come from disk, the rest is recomputed (the restarted Redis no
   longer holds them), and the greedy text is unchanged.

Writes bench/results/tiers_cluster.json and .png (latency of each load request, and where
its cached tokens came from, around the kill).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import redis as redis_client

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, RedisServer, free_port, pyplot, running_server, running_servers, save_png, write_json
from tests.serve_client import block_file, block_keys, complete, flip_byte, metric, store_events, wait_for_puts

BLOCK = 16
NEW = 16  # greedy tokens compared (a 2,048-token prompt + 16: KV for 2,063, no decode block completes)
COOLDOWN_S = 5.0  # RemoteStore's breaker cool-down (its default)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(200, 49000) for _ in range(n)]


def reusable(n: int) -> int:
    """What a repeat of an ``n``-token prompt can report cached: its full blocks, less the
    last one when it ends on a boundary (the last prompt token is always computed)."""
    return (n - 1) // BLOCK * BLOCK


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def outcome(c) -> dict:
    return {
        "prompt_tokens": c.prompt_tokens,
        "cached_tokens": c.cached_tokens,
        "by_tier": c.by_tier,
        "seconds": round(c.seconds, 3),
    }


def run_load(a: str, b: str, redis: RedisServer, n: int, seed: int) -> dict:
    """``n`` requests, 4 in flight, A and B alternating; Redis killed once half are done."""
    system = tokens(64, seed)  # a shared system prompt: device hits on each executor
    prompts = [system + tokens(96, seed + 1 + j) for j in range(n // 2)]

    def planned(k: int) -> tuple[str, str, list[int]]:
        """Request ``k``: A asks prompt k/2; B asks the one A asked two pairs before (its own at first)."""
        j = k // 2
        if k % 2 == 0:
            return "A", f"p{j}", prompts[j]
        return ("B", f"p{j - 2}", prompts[j - 2]) if j >= 2 else ("B", f"b{j}", system + tokens(96, seed + 500 + j))

    lock = threading.Lock()
    done: list[int] = []
    killed_at: list[float] = []
    rows: list[dict] = [{} for _ in range(n)]
    start = time.monotonic()

    def one(k: int) -> None:
        server, label, prompt = planned(k)
        url = a if server == "A" else b
        row = {"k": k, "server": server, "prompt": label, "start_s": round(time.monotonic() - start, 3)}
        try:
            r = httpx.post(
                f"{url}/v1/completions",
                timeout=600,
                json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            )
            row["status"] = r.status_code
            if r.status_code == 200:
                doc = r.json()
                details = doc["usage"]["prompt_tokens_details"]
                row |= {
                    "cached": details["cached_tokens"],
                    "by_tier": details["cached_tokens_by_tier"],
                    "completion_tokens": doc["usage"]["completion_tokens"],
                    "finish_reason": doc["choices"][0]["finish_reason"],
                }
            else:
                row["error"] = r.text[:300]
        except httpx.HTTPError as exc:
            row |= {"status": None, "error": repr(exc)}
        row["end_s"] = round(time.monotonic() - start, 3)
        with lock:
            rows[k] = row
            done.append(k)
            if len(done) == n // 2 and not killed_at:
                redis.stop()  # SIGKILL, as a crash; the other requests are running or queued
                killed_at.append(time.monotonic() - start)
                log(f"redis-server killed after {len(done)} of {n} requests")

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(n)))
    ok = [
        r
        for r in rows
        if r.get("status") == 200 and r.get("finish_reason") == "length" and r.get("completion_tokens") == 8
    ]
    before = [r for r in rows if r["end_s"] <= killed_at[0]]
    after = [r for r in rows if r["start_s"] > killed_at[0]]
    return {
        "requests": n,
        "in_flight": 4,
        "failed": n - len(ok),
        "killed_at_s": round(killed_at[0], 3),
        "killed_after_completed": n // 2,
        "remote_hit_tokens_before_kill": sum(r.get("by_tier", {}).get("remote", 0) for r in before),
        "remote_hit_tokens_started_after_kill": sum(r.get("by_tier", {}).get("remote", 0) for r in after),
        "requests_started_after_kill": len(after),
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--load", type=int, default=40)
    ap.add_argument("--kv-cache-memory", default="0.15", help="GiB per executor (must hold one prompt)")
    ap.add_argument("--host-cache-memory", default="0.5")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=str(RESULTS / "tiers_cluster.json"))
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="kvreuse-tiers-cluster-"))
    redis = RedisServer(workdir)
    if redis.binary is None:
        raise SystemExit("bench/tiers/tiers_cluster.py needs redis-server (apt-get install redis-server)")
    redis.start()
    disk = workdir / "disk-a"
    common = [
        "--model",
        args.model,
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--host-cache-memory",
        args.host_cache_memory,
        "--remote-cache",
        redis.url,
        "--log-level",
        "info",
    ]
    a_args, b_args = [*common, "--disk-cache-dir", str(disk)], common
    p = tokens(args.prompt, args.seed)
    blocks = args.prompt // BLOCK  # written through per computation of p (NEW completes no block)
    result: dict = {
        "model": args.model,
        "prompt_tokens": args.prompt,
        "block_size": BLOCK,
        "load_average_start": round(os.getloadavg()[0], 2),
    }
    started = time.monotonic()
    try:
        with running_servers([(free_port(), a_args, workdir / "a.log"), (free_port(), b_args, workdir / "b.log")]) as (
            a,
            b,
        ):
            log(f"A {a}, B {b}, redis {redis.url}")
            # 1. sharing and isolation
            on_a = complete(a, p, max_tokens=NEW)
            wait_for_puts(a, "remote", blocks, timeout_s=120)
            wait_for_puts(a, "disk", blocks, timeout_s=120)
            b_own = complete(b, p, max_tokens=NEW, salt="tenant-b")  # B computing it itself
            b_shared = complete(b, p, max_tokens=NEW)
            wait_for_puts(b, "remote", blocks, timeout_s=120)
            a_salted = complete(a, p, max_tokens=NEW, salt="tenant-b")
            keys_in_redis = redis_client.Redis.from_url(redis.url).dbsize()
            result["sharing"] = {
                "computed_on_a": outcome(on_a),
                "b_computes_it_salted": outcome(b_own),
                "b_after_a": outcome(b_shared),
                "same_greedy_text": b_shared.text == b_own.text == on_a.text,
                "pass": b_shared.cached_tokens >= args.prompt - BLOCK
                and b_shared.by_tier["remote"] == b_shared.cached_tokens
                and b_shared.text == b_own.text == on_a.text,
            }
            result["isolation"] = {
                "b_salted_while_redis_held_a_unsalted_chain": outcome(b_own),
                "a_under_b_salt": outcome(a_salted),
                "redis_keys": keys_in_redis,
                "expected_keys": 2 * blocks,
                "pass": b_own.cached_tokens == 0
                and a_salted.by_tier["device"] == a_salted.by_tier["disk"] == 0
                and a_salted.cached_tokens == reusable(args.prompt)
                and keys_in_redis == 2 * blocks,
            }
            log(f"sharing: {result['sharing']['pass']}, isolation: {result['isolation']['pass']}")
            # 2. Redis killed under load, then back
            load = run_load(a, b, redis, args.load, args.seed + 100)
            load["remote_counters_after_load"] = {"A": store_events(a, "remote"), "B": store_events(b, "remote")}
            log(f"load: {load['failed']} failed of {load['requests']}")
            redis.start()
            restarted = time.monotonic()
            time.sleep(COOLDOWN_S + 0.5)  # the breakers' cool-down: the next call on each probes
            q = tokens(512, args.seed + 2)
            before = sum(store_events(a, "remote").get(k, 0) for k in ("puts", "put_failures"))
            complete(a, q)
            wait_for_puts(a, "remote", before + 512 // BLOCK, timeout_s=60)
            resumed = complete(b, q)
            load["after_restart"] = {
                "b_asks_what_a_computed": outcome(resumed),
                "seconds_after_redis_restart": round(time.monotonic() - restarted, 2),
                "breaker_open": {
                    "A": metric(a, "kvreuse:remote_tier_breaker_open"),
                    "B": metric(b, "kvreuse:remote_tier_breaker_open"),
                },
            }
            load["pass"] = load["failed"] == 0 and resumed.by_tier["remote"] == reusable(512)
            result["redis_kill"] = load
            log(f"redis kill: {load['pass']}")
        # 3. restart from disk (B stopped too; the restarted Redis does not hold p)
        t = time.monotonic()
        with running_server(free_port(), a_args, workdir / "a2.log") as a:
            startup = time.monotonic() - t
            again = complete(a, p, max_tokens=NEW)
            keys = block_keys(a, p)
        result["restart"] = {
            "first_repeat": outcome(again),
            "startup_s": round(startup, 1),
            "same_greedy_text": again.text == on_a.text,
            "pass": again.by_tier["disk"] >= args.prompt - BLOCK and again.text == on_a.text,
        }
        log(f"restart: {result['restart']['pass']}")
        # 4. a corrupted block file
        victim_index = blocks // 2
        victim = block_file(disk, keys[victim_index])
        flip_byte(victim)
        with running_server(free_port(), a_args, workdir / "a3.log") as a:
            damaged = complete(a, p, max_tokens=NEW)
            corrupt = metric(a, "kvreuse:disk_tier_events_total", event="corrupt")
        lines = [line for line in (workdir / "a3.log").read_text().splitlines() if "refused corrupt block file" in line]
        result["corruption"] = {
            "corrupted_block": victim_index,
            "answer": outcome(damaged),
            "same_greedy_text": damaged.text == on_a.text,
            "corrupt_counter": corrupt,
            "log_line": lines[0].replace(str(workdir), "<tmp>") if lines else None,
            "pass": corrupt == 1
            and bool(lines)
            and damaged.text == on_a.text
            and damaged.by_tier["disk"] == victim_index * BLOCK,
        }
        log(f"corruption: {result['corruption']['pass']}")
    finally:
        redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    result["wall_s"] = round(time.monotonic() - started, 1)
    result["load_average_end"] = round(os.getloadavg()[0], 2)
    result["command"] = "python bench/tiers/tiers_cluster.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    write_json(out, result, indent=1)
    summary = {
        k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk != "rows"})
        for k, v in result.items()
    }
    print(json.dumps(summary, indent=2))
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    load = result["redis_kill"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for server, colour in (("A", "#49c"), ("B", "#c55")):
        rows = [r for r in load["rows"] if r["server"] == server]
        ax.scatter(
            [r["end_s"] for r in rows],
            [r["end_s"] - r["start_s"] for r in rows],
            color=colour,
            s=18,
            label=f"executor {server}: latency (s)",
            zorder=3,
        )
    remote = [r for r in load["rows"] if r.get("by_tier", {}).get("remote")]
    ax.scatter(
        [r["end_s"] for r in remote],
        [r["end_s"] - r["start_s"] for r in remote],
        facecolors="none",
        edgecolors="black",
        s=60,
        label="served partly from Redis",
        zorder=4,
    )
    ax.axvline(load["killed_at_s"], color="black", linestyle="--")
    ax.annotate("redis-server killed", (load["killed_at_s"], ax.get_ylim()[1] * 0.95), fontsize=8, ha="left")
    ax.set_xlabel("seconds since the load started (request completion)")
    ax.set_ylabel("request latency (s)")
    ax.set_title(
        f"{result['model']}: {load['requests']} requests, 4 in flight, Redis killed after "
        f"{load['killed_after_completed']}: {load['failed']} failed",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
