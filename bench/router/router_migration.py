"""SIGKILL of one of two executors during a streaming load, with mid-stream migration on
(``--migration-limit 3``, the default) and off (``0``): how many streams end whole and
identical to an uninterrupted run, how many end with the router's error event, how many
are cut silently (no ``[DONE]``, no error), and the stall a migrated stream sees.

    PYTHONPATH=src .venv/bin/python bench/router/router_migration.py [--model tiny:llama] [--runs 5]
        [--streams 60] [--max-tokens 200] [--kv-cache-memory 0.03]

Two ``kvreuse serve`` executors (``--max-num-seqs`` streams + 4, and a pool that holds every
stream: the survivor takes the continuations at once) behind two routers (limit 3 and limit 0, both round robin,
over the same executors). First the uninterrupted reference: every request streamed
through the limit-3 router with no fault. Then ``--runs`` interleaved pairs of runs (limit
3, limit 0, limit 3, ...): ``--streams`` greedy streams at once (half completions, half
chat, ``ignore_eos``), and once every stream has its first chunks the executor serving the
first one is SIGKILLed (SIGTERM to this script leaves the executors running: stop it with
Ctrl-C); it is restarted after the run. Stall: each stream's longest gap between two events,
for the streams that were on the victim and for the others (which share the surviving
executor with the continued ones), and each run's median gap.
A request refused before its first byte (e.g. a 503 while a loaded router's health probes
time out) is counted as ``refused``, apart from the cut streams. Writes
bench/results/router_migration.json and bench/results/router_migration.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, Proc, free_port, pyplot, router, save_png, wait_healthy, write_json
from tests.serve_client import metric

EXECUTOR_HEADER = "x-kvreuse-executor"


def request(i: int, max_tokens: int) -> tuple[str, dict]:
    prompt = " ".join(f"request {i} clause {j} of a prompt streamed under fire;" for j in range(10))
    body = {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if i % 2:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def stream(url: str, path: str, body: dict, seen=None) -> dict:
    """One stream's executor, events (parsed) and arrival times. A request whose connection
    fails before its headers (the router refused or dropped it) is recorded as refused, with
    ``status`` ``None`` and the error; ``seen`` then hears that it is over, as for a refusal."""
    events, times = [], []
    served_by, answered = None, False  # no executor, no headers yet
    try:
        with httpx.stream("POST", url + path, json=body, timeout=300) as r:
            served_by, answered = r.headers.get(EXECUTOR_HEADER), True
            if r.status_code != 200:  # refused before any byte (e.g. a 503: no executor healthy)
                events.append({"status": r.status_code, "body": r.read().decode(errors="replace")[:300]})
                if seen is not None:
                    seen(served_by, 1_000_000)
                return {"executor": served_by, "events": events, "times": times}
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                    times.append(time.perf_counter())
                    if seen is not None:
                        seen(served_by, len(events))
    except httpx.HTTPError as exc:
        if not answered:  # no headers: refused before any byte, like a 503
            events.append({"status": None, "transport_error": repr(exc)})
        else:  # the connection broke mid-stream: a cut without an event
            events.append({"transport_error": repr(exc)})
        if seen is not None:
            seen(served_by, 1_000_000)  # over: it holds back no kill
    return {"executor": served_by, "events": events, "times": times}


def outcome(result: dict, chat: bool) -> tuple[str, str]:
    """("whole" | "error_event" | "silent_cut" | "refused", the reply's text)."""
    events = result["events"]
    if events and isinstance(events[0], dict) and "status" in events[0]:
        return "refused", ""
    text = "".join(
        ((c.get("delta") or {}).get("content") or "") if chat else c.get("text", "")
        for e in events
        if isinstance(e, dict)
        for c in e.get("choices") or []
    )
    if any(isinstance(e, dict) and "error" in e for e in events):
        return "error_event", text
    if events and events[-1] == "[DONE]":
        return "whole", text
    return "silent_cut", text


def one_run(url: str, requests: list[tuple[str, dict]], kill) -> tuple[list[dict], str]:
    progress: dict[int, tuple[str, int]] = {}
    ready = threading.Event()
    lock = threading.Lock()

    def seen_by(i: int):
        def seen(served_by: str, n: int) -> None:
            with lock:
                progress[i] = (served_by, n)
                if len(progress) == len(requests) and all(k >= 3 for _, k in progress.values()):
                    ready.set()

        return seen

    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(stream, url, path, body, seen_by(i)) for i, (path, body) in enumerate(requests)]
        if not ready.wait(300):
            raise RuntimeError(f"streams never all started: {len(progress)} of {len(requests)}")
        victim = next(served_by for _, (served_by, _) in sorted(progress.items()) if served_by)
        kill(victim)
        killed_at = time.perf_counter()
        results = [f.result(timeout=600) for f in futures]
    for r in results:
        r["killed_at"] = killed_at
    return results, victim


def stall(result: dict) -> float:
    """The longest gap between two of the stream's events, in seconds."""
    t = result["times"]
    return max((b - a for a, b in zip(t, t[1:])), default=0.0)


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    configs = list(summary["configs"])
    kinds = [
        ("whole_identical", "whole, identical", "tab:green"),
        ("whole_differing", "whole, differing", "tab:olive"),
        ("error_event", "ended with error event", "tab:orange"),
        ("silent_cut", "silent cut", "tab:red"),
        ("refused", "refused before the first byte", "tab:gray"),
    ]
    bottom = [0.0] * len(configs)
    for key, label, color in kinds:
        values = [summary["configs"][c]["median_streams"][key] for c in configs]
        left.bar(configs, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    left.set_ylabel(f"streams of {summary['streams']} (median of {summary['runs']} runs)")
    left.set_title("SIGKILL of 1 of 2 executors mid-stream")
    left.legend(fontsize=8, loc="lower right")
    migrated = summary["configs"]["limit 3"]
    right.boxplot(
        [migrated["stalls_on_victim_s"], migrated["stalls_elsewhere_s"], migrated["median_gap_all_s"]],
        tick_labels=["longest gap,\nstreams on the victim", "longest gap,\nother streams", "median gap,\nper run"],
    )
    right.set_ylabel("seconds")
    right.set_title("migration (limit 3): what a stream waits")
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--runs", type=int, default=5, help="runs per configuration (interleaved)")
    ap.add_argument("--streams", type=int, default=60)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--kv-cache-memory", type=float, default=0.03, help="GiB per executor (all streams fit one)")
    args = ap.parse_args()
    logs = tempfile.mkdtemp(prefix="router-migration-")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    port_of = dict(zip(urls, ports))

    def start(url: str):
        # room for every stream on one executor: a continuation is admitted at once, so its stall is
        # the migration's (break seen, prefill of prompt + ids sent), not a wait for a free slot
        return Proc(
            [
                "serve",
                "--model",
                args.model,
                "--port",
                str(port_of[url]),
                "--device",
                "cpu",
                "--kv-cache-memory",
                str(args.kv_cache_memory),
                "--max-model-len",
                "1024",
                "--max-num-seqs",
                str(args.streams + 4),
                "--event-buffer-max-size",
                "10000",
                "--log-level",
                "warning",
            ],
            f"{logs}/executor-{port_of[url]}.log",
        ).start()

    execs = {url: start(url) for url in urls}
    rports = {"limit 3": free_port(), "limit 0": free_port()}
    routers = {
        name: router(p, urls, logs, "--routing-policy", "round_robin", "--migration-limit", name.split()[1])
        for name, p in rports.items()
    }
    rurl = {name: f"http://127.0.0.1:{p}" for name, p in rports.items()}
    requests = [request(i, args.max_tokens) for i in range(args.streams)]
    chat = [path.endswith("chat/completions") for path, _ in requests]
    runs: list[dict] = []
    try:
        for url in urls:
            wait_healthy(url, list(execs.values()), timeout=600)
        for r in routers.values():
            r.start()
        for name in routers:
            wait_healthy(rurl[name], [*execs.values(), *routers.values()], timeout=300, all_of=2)
        with ThreadPoolExecutor(args.streams) as pool:  # the uninterrupted reference, same load
            reference = list(pool.map(lambda pr: stream(rurl["limit 3"], *pr), requests))
        ref_text = []
        for r, c in zip(reference, chat):
            kind, text = outcome(r, c)
            assert kind == "whole", f"the reference run failed: {r['events'][-2:]}"
            ref_text.append(text)

        def kill(url: str) -> None:
            execs[url].kill()

        for run in range(args.runs):
            for name in routers:
                before = {
                    o: metric(rurl[name], "kvreuse:router_migrations_total", outcome=o)
                    for o in ("continued", "limit", "no_executor", "unsupported", "failed", "finished")
                }
                results, victim = one_run(rurl[name], requests, kill)
                counts = {"whole_identical": 0, "whole_differing": 0, "error_event": 0, "silent_cut": 0, "refused": 0}
                for r, c, ref in zip(results, chat, ref_text):
                    kind, text = outcome(r, c)
                    counts[("whole_identical" if text == ref else "whole_differing") if kind == "whole" else kind] += 1
                on_victim = [r for r in results if r["executor"] == victim]
                gaps = [
                    statistics.median([b - a for a, b in zip(r["times"], r["times"][1:])])
                    for r in results
                    if len(r["times"]) > 2
                ]
                runs.append(
                    {
                        "config": name,
                        "run": run,
                        "victim": victim,
                        "streams_on_victim": len(on_victim),
                        **counts,
                        "migrations": {
                            o: metric(rurl[name], "kvreuse:router_migrations_total", outcome=o) - before[o]
                            for o in before
                        },
                        "stalls_on_victim_s": [round(stall(r), 4) for r in on_victim],
                        "stalls_elsewhere_s": [round(stall(r), 4) for r in results if r["executor"] != victim],
                        "median_gap_all_s": round(statistics.median(gaps), 4),
                    }
                )
                print(json.dumps({k: v for k, v in runs[-1].items() if not k.startswith("stalls")}), flush=True)
                execs[victim] = start(victim)
                wait_healthy(victim, list(execs.values()), timeout=600)
                for n in routers:
                    wait_healthy(rurl[n], [*execs.values(), *routers.values()], timeout=300, all_of=2)
                time.sleep(2.0)  # let the restarted executor settle before the next burst
    finally:
        for p in [*routers.values(), *execs.values()]:
            p.stop()

    summary: dict = {
        "model": args.model,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "executors": 2,
        "max_num_seqs": args.streams + 4,
        "kv_cache_memory_gib": args.kv_cache_memory,
        "configs": {},
        "runs_detail": runs,
    }
    for name in routers:
        mine = [r for r in runs if r["config"] == name]
        summary["configs"][name] = {
            "median_streams": {
                k: statistics.median(r[k] for r in mine)
                for k in (
                    "whole_identical",
                    "whole_differing",
                    "error_event",
                    "silent_cut",
                    "refused",
                    "streams_on_victim",
                )
            },
            "total_refused": sum(r["refused"] for r in mine),
            "total_silent_cuts": sum(r["silent_cut"] for r in mine),
            "total_differing": sum(r["whole_differing"] for r in mine),
            "stalls_on_victim_s": sorted(s for r in mine for s in r["stalls_on_victim_s"]),
            "median_stall_on_victim_s": statistics.median([s for r in mine for s in r["stalls_on_victim_s"]] or [0]),
            "stalls_elsewhere_s": sorted(s for r in mine for s in r["stalls_elsewhere_s"]),
            "median_stall_elsewhere_s": statistics.median([s for r in mine for s in r["stalls_elsewhere_s"]] or [0]),
            "median_gap_all_s": [r["median_gap_all_s"] for r in mine],
        }
    out = RESULTS
    write_json(out / "router_migration.json", summary)
    plot(summary, out / "router_migration.png")
    print(
        f"{'config':>8} {'whole=':>7} {'whole!=':>8} {'error':>6} {'silent':>7} {'on victim':>10} "
        f"{'stall victim':>13} {'stall others':>13}"
    )
    for name, c in summary["configs"].items():
        m = c["median_streams"]
        print(
            f"{name:>8} {m['whole_identical']:>7} {m['whole_differing']:>8} {m['error_event']:>6} "
            f"{m['silent_cut']:>7} {m['streams_on_victim']:>10} {c['median_stall_on_victim_s']:>13.3f} "
            f"{c['median_stall_elsewhere_s']:>13.3f}"
        )


if __name__ == "__main__":
    main()
