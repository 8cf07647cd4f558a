"""Tenant limits: what admission costs, and what a limit buys another tenant.

    PYTHONPATH=src .venv/bin/python bench/router/tenant_limits.py [--model tiny:llama] [--runs 5]

1. ``policy``: one request's ``TenantLimiter.open`` + ``reserve`` + ``record`` + ``close``
   (in-flight slot and token bucket), median over repeats: what the limits add per request.
2. ``flood``: one executor behind two routers that differ only in ``--tenant-max-in-flight 2``.
   Tenant ``alice`` floods: 16 threads each sending streamed completions back to back (a
   429 is retried after its ``retry-after-ms``, as the official client does), while tenant ``bob`` sends 6
   completions one after another and times each. Three modes, interleaved run by run:
   ``alone`` (bob, no flood), ``flood_limited`` (through the limited router), ``flood_unlimited``.
   Per mode: bob's median latency (median over runs of each run's median), alice's streams
   served and refused per run, and alice's in-flight gauge on the router after the run (0:
   no slot outlives its request).

Writes bench/results/tenant_limits.json and tenant_limits.png (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import ROOT, executor, free_port, pyplot, router, save_png, wait_healthy, write_json
from tests.serve_client import metric

ADMIN, ALICE, BOB = "bench-admin", "bench-alice", "bench-bob"
KEYS = ["--api-key", ADMIN, "--api-key", f"{ALICE}:alice", "--api-key", f"{BOB}:bob"]
MODES = ("alone", "flood_limited", "flood_unlimited")


def policy_us(repeats: int = 20000) -> float:
    from kvreuse.api.limiter import TenantLimiter
    from kvreuse.api.tenant_limits import Limits, TenantLimits

    limiter = TenantLimiter(TenantLimits(default=Limits(max_in_flight=8, tokens_per_minute=10**12)))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        lease = limiter.open("alice")
        lease.reserve(100, 16)
        lease.record(110)
        lease.close()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def _prompt(i: int) -> str:
    return " ".join(f"word{(i * 7 + j) % 50}" for j in range(40))


def _alice(url: str, stop: threading.Event, counts: dict[str, int], lock: threading.Lock, seed: int) -> None:
    body = {"prompt": _prompt(seed), "max_tokens": 32, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            with http.stream(
                "POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {ALICE}"}
            ) as r:
                kind = "served" if r.status_code == 200 else "refused" if r.status_code == 429 else "other"
                wait_s = int(r.headers.get("retry-after-ms", "50")) / 1000
                for _ in r.iter_lines():
                    pass
            with lock:
                counts[kind] += 1
            if kind != "served":
                stop.wait(wait_s)


def _bob(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=120) as http:
        for i in range(n):
            t = time.perf_counter()
            r = http.post(
                f"{url}/v1/completions",
                headers={"Authorization": f"Bearer {BOB}"},
                json={"prompt": _prompt(1000 + i), "max_tokens": 16, "ignore_eos": True, "temperature": 0},
            )
            r.raise_for_status()
            out.append(time.perf_counter() - t)
    return out


def one_run(mode: str, limited: str, unlimited: str, bob_requests: int) -> dict:
    url = unlimited if mode == "flood_unlimited" else limited
    counts, lock, stop = {"served": 0, "refused": 0, "other": 0}, threading.Lock(), threading.Event()
    threads = [threading.Thread(target=_alice, args=(url, stop, counts, lock, i)) for i in range(16)]
    if mode != "alone":
        for t in threads:
            t.start()
        time.sleep(1.0)  # the flood is on before bob starts
    latencies = _bob(url, bob_requests)
    stop.set()
    for t in threads if mode != "alone" else ():
        t.join()
    return {
        "mode": mode,
        "bob_latency_s": latencies,
        "bob_median_s": statistics.median(latencies),
        "alice": dict(counts),
        "alice_in_flight_after": metric(limited, "kvreuse:router_tenant_requests_in_flight", tenant="alice"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bob-requests", type=int, default=6)
    args = ap.parse_args()
    logs = tempfile.mkdtemp(prefix="tenant-limits-")
    eport, lport, uport = free_port(), free_port(), free_port()
    eurl = f"http://127.0.0.1:{eport}"
    procs = [executor(eport, logs, args.model)]
    procs.append(router(lport, [eurl], logs, *KEYS, "--tenant-max-in-flight", "2"))
    procs.append(router(uport, [eurl], logs, *KEYS))
    result: dict = {"model": args.model, "policy_us_per_request": policy_us()}
    try:
        procs[0].start()
        wait_healthy(eurl, procs[:1], timeout=300)
        for p in procs[1:]:
            p.start()
        limited, unlimited = f"http://127.0.0.1:{lport}", f"http://127.0.0.1:{uport}"
        wait_healthy(limited, procs, all_of=1)
        wait_healthy(unlimited, procs, all_of=1)
        _bob(limited, 2)  # warm up
        runs = [one_run(mode, limited, unlimited, args.bob_requests) for _ in range(args.runs) for mode in MODES]
    finally:
        for p in procs:
            p.stop()
    result["runs"] = runs
    result["summary"] = {
        mode: {
            "bob_median_s": statistics.median(r["bob_median_s"] for r in runs if r["mode"] == mode),
            "alice_served_per_run": statistics.median(r["alice"]["served"] for r in runs if r["mode"] == mode),
            "alice_refused_per_run": statistics.median(r["alice"]["refused"] for r in runs if r["mode"] == mode),
            "alice_in_flight_after_max": max(r["alice_in_flight_after"] for r in runs if r["mode"] == mode),
        }
        for mode in MODES
    }
    out = ROOT / "bench" / "results" / "tenant_limits.json"
    write_json(out, result)
    print(json.dumps({"policy_us_per_request": result["policy_us_per_request"], **result["summary"]}, indent=2))
    _plot(result, out.with_suffix(".png"))


def _plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, mode in enumerate(MODES):
        values = [r["bob_median_s"] * 1e3 for r in result["runs"] if r["mode"] == mode]
        ax.bar(i, statistics.median(values), color=["#888", "#2a7", "#c44"][i])
        ax.scatter([i] * len(values), values, color="black", s=10, zorder=3)
    ax.set_xticks(range(len(MODES)), ["bob alone", "alice floods,\nmax_in_flight 2", "alice floods,\nno limit"])
    ax.set_ylabel("bob's latency per request (ms)")
    ax.set_title(f"Another tenant's latency under a flood ({result['model']}; dots: runs)")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
