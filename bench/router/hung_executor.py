"""SIGSTOP of one of two executors for 40 s under 40 greedy streams (issue 31, finding 2):
how long a stream of the stopped executor waits, how many end whole and identical to an
uninterrupted run, with the router's error event, or cut silently.

    PYTHONPATH=src .venv/bin/python bench/router/hung_executor.py [--model tiny:llama] [--streams 40]
        [--max-tokens 300] [--stop-s 40] [--kv-cache-memory 0.03]

Two ``kvreuse serve`` executors behind two ``kvreuse route`` routers, both round robin with
the default deadlines (``--upstream-progress-timeout 10``, ``kvreuse.router.deadline``):
``probed`` probes health every second (the default), so the stop is noticed by a failed probe
(2 s timeout) and the stream moves 1 s later; ``deadline only`` probes every 600 s, so only
the 10 s progress deadline can notice it. First the uninterrupted reference through
``probed``; then, per router, ``--streams`` streams at once (half completions, half chat,
``ignore_eos``), and once every stream has its first chunks the executor serving the first
is SIGSTOPped, then SIGCONTed ``--stop-s`` later (after every stream ended). Longest gap:
each stream's longest wait between two events, on the stopped executor and elsewhere.
Writes bench/results/hung_executor.json and .png.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, Proc, free_port, pyplot, router, save_png, wait_healthy, write_json
from bench.router.router_migration import one_run, outcome, request, stall, stream


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(summary["configs"])
    data, labels = [], []
    for name in names:
        c = summary["configs"][name]
        data += [c["longest_gap_on_stopped_s"] or [0.0], c["longest_gap_elsewhere_s"] or [0.0]]
        labels += [f"{name}:\non the stopped one", f"{name}:\nelsewhere"]
    ax.boxplot(data, tick_labels=labels)
    ax.axhline(10.0, color="tab:red", linestyle="--", linewidth=1, label="--upstream-progress-timeout (10 s)")
    ax.set_ylabel("longest wait between two events (s)")
    ax.set_title(f"SIGSTOP of 1 of 2 executors under {summary['streams']} streams")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny:llama")
    ap.add_argument("--streams", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=300)
    ap.add_argument("--stop-s", type=float, default=40.0, help="how long the executor stays stopped")
    ap.add_argument("--kv-cache-memory", type=float, default=0.03, help="GiB per executor (all streams fit one)")
    args = ap.parse_args()
    logs = tempfile.mkdtemp(prefix="hung-executor-")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    execs = {
        url: Proc(
            [
                "serve",
                "--model",
                args.model,
                "--port",
                str(port),
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
            f"{logs}/executor-{port}.log",
        )
        for url, port in zip(urls, ports)
    }
    rports = {"probed": free_port(), "deadline only": free_port()}
    routers = {
        "probed": router(rports["probed"], urls, logs, "--routing-policy", "round_robin", "--health-interval", "1"),
        "deadline only": router(
            rports["deadline only"], urls, logs, "--routing-policy", "round_robin", "--health-interval", "600"
        ),
    }
    rurl = {name: f"http://127.0.0.1:{p}" for name, p in rports.items()}
    requests = [request(i, args.max_tokens) for i in range(args.streams)]
    chat = [path.endswith("chat/completions") for path, _ in requests]
    summary: dict = {
        "model": args.model,
        "streams": args.streams,
        "max_tokens": args.max_tokens,
        "stop_s": args.stop_s,
        "upstream_progress_timeout_s": 10.0,
        "configs": {},
    }
    try:
        for p in execs.values():
            p.start()
        for url in urls:
            wait_healthy(url, list(execs.values()), timeout=600)
        for r in routers.values():
            r.start()
        for name in routers:
            wait_healthy(rurl[name], [*execs.values(), *routers.values()], timeout=300, all_of=2)
        with ThreadPoolExecutor(args.streams) as pool:  # the uninterrupted reference, same load
            reference = list(pool.map(lambda pr: stream(rurl["probed"], *pr), requests))
        ref_text = []
        for r, c in zip(reference, chat):
            kind, text = outcome(r, c)
            assert kind == "whole", f"the reference run failed: {r['events'][-2:]}"
            ref_text.append(text)
        for name in routers:
            stopped: dict[str, float] = {}

            def stop(url: str) -> None:
                execs[url].popen.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
                stopped[url] = time.monotonic()

            results, victim = one_run(rurl[name], requests, stop)
            time.sleep(max(0.0, stopped[victim] + args.stop_s - time.monotonic()))
            execs[victim].popen.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
            counts = {"whole_identical": 0, "whole_differing": 0, "error_event": 0, "silent_cut": 0, "refused": 0}
            for r, c, ref in zip(results, chat, ref_text):
                kind, text = outcome(r, c)
                counts[("whole_identical" if text == ref else "whole_differing") if kind == "whole" else kind] += 1
            on = sorted(round(stall(r), 3) for r in results if r["executor"] == victim)
            off = sorted(round(stall(r), 3) for r in results if r["executor"] != victim)
            summary["configs"][name] = {
                **counts,
                "streams_on_stopped": len(on),
                "longest_gap_on_stopped_s": on,
                "longest_gap_elsewhere_s": off,
                "max_gap_on_stopped_s": max(on, default=0.0),
                "median_gap_on_stopped_s": statistics.median(on or [0.0]),
            }
            print(name, {k: v for k, v in summary["configs"][name].items() if not k.startswith("longest")}, flush=True)
            wait_healthy(rurl["probed"], [*execs.values(), *routers.values()], timeout=300, all_of=2)
    finally:
        for p in execs.values():
            if p.popen is not None and p.popen.poll() is None:
                p.popen.send_signal(signal.SIGCONT)
        for p in [*routers.values(), *execs.values()]:
            p.stop()
    write_json(RESULTS / "hung_executor.json", summary)
    plot(summary, RESULTS / "hung_executor.png")


if __name__ == "__main__":
    main()
