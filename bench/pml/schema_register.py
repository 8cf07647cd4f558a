"""A big schema registered while a client streams: the streaming client's inter-token gap.

One ``kvreuse serve`` per run (fresh process, default model unless ``--model``); a client
streams a greedy completion (``ignore_eos``); once it has ``--lead-tokens`` tokens, a union of
``--members`` small modules (~45 KB of PML for 500) is POSTed to ``/v1/schemas`` and, while it
registers, a 1-token completion probes what a newly arriving request waits. Per run: the
POST's seconds, the largest gap between two streamed tokens while the POST was open, the
median gap before it, and the probe's latency.

``--before-src DIR`` runs the same measurement against another checkout's ``src`` (e.g. main
before the change) in the same process order, interleaved run by run (before, after, before,
after, ...); the figures are medians over ``--runs`` runs of each.

    PYTHONPATH=src .venv/bin/python bench/pml/schema_register.py --before-src CHECKOUT/src [--runs 5]

Writes bench/results/schema_register.json and .png.
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
from bench.common import RESULTS, ROOT, free_port, pyplot, running_server, save_png, write_json

STREAM_PROMPT = "Write a long story about a lighthouse keeper and the ships she counts."


def union_schema(name: str, members: int) -> str:
    """A system turn, then a union of ``members`` one-line facts (a RAG document set)."""
    rows = "\n".join(
        f'    <module name="f{i}">Fact {i}: the keeper of lighthouse {i} logs every ship at dusk.</module>'
        for i in range(members)
    )
    return (
        f'<schema name="{name}">\n  <system>Answer from the facts given.</system>\n'
        f"  <union>\n{rows}\n  </union>\n</schema>"
    )


class Stream:
    """A streaming completion in a thread: the arrival time of every token."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.times: list[float] = []
        self.stop = threading.Event()
        self.error: str | None = None
        body = {"prompt": STREAM_PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.times.append(time.perf_counter())
                    if self.stop.is_set():
                        return  # closing the stream aborts the request
        except Exception as exc:  # noqa: BLE001 - reported in the result
            self.error = repr(exc)


def run_once(src: str, label: str, args: argparse.Namespace, run: int) -> dict:
    port = free_port()
    serve = ["--model", args.model, "--log-level", "warning", *args.serve_arg]
    with (
        tempfile.TemporaryDirectory() as tmp,
        running_server(port, serve, Path(tmp) / "serve.log", env_path=src) as url,
    ):
        httpx.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120)  # warm up
        stream = Stream(url, args.stream_tokens)
        while len(stream.times) < args.lead_tokens and stream.error is None:
            time.sleep(0.01)
        text = union_schema(f"facts{run}", args.members)
        t0 = time.perf_counter()
        probe: dict = {}

        def probe_request() -> None:
            time.sleep(args.probe_after_s)
            start = time.perf_counter()
            r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=600)
            probe.update(status=r.status_code, seconds=time.perf_counter() - start)

        prober = threading.Thread(target=probe_request, daemon=True)
        prober.start()
        r = httpx.post(url + "/v1/schemas", json={"schema": text}, timeout=1800)
        t1 = time.perf_counter()
        prober.join()
        n_after = len(stream.times)
        while len(stream.times) < n_after + 5 and stream.error is None and stream.thread.is_alive():
            time.sleep(0.01)
        stream.stop.set()
        stream.thread.join(60)
        times = stream.times
        during = [b - a for a, b in zip(times, times[1:]) if b > t0 and a < t1]
        before = [b - a for a, b in zip(times, times[1:]) if b <= t0]
        info = r.json() if r.status_code == 200 else {"error": r.text}
    return {
        "variant": label,
        "run": run,
        "status": r.status_code,
        "post_bytes": len(text.encode()),
        "register_s": t1 - t0,
        "max_gap_during_s": max(during) if during else t1 - t0,
        "median_gap_before_s": statistics.median(before) if before else None,
        "tokens_during": sum(1 for t in times if t0 < t <= t1),
        "probe_s": probe.get("seconds"),
        "probe_status": probe.get("status"),
        "computed": info.get("computed"),
        "stored_tokens": info.get("stored_tokens"),
        "stream_error": stream.error,
    }


def summary(rows: list[dict]) -> dict:
    out = {}
    for label in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == label and r["status"] == 200]
        out[label] = (
            {
                k: statistics.median(r[k] for r in mine)
                for k in ("register_s", "max_gap_during_s", "median_gap_before_s", "probe_s")
            }
            if mine
            else {}
        )
        out[label]["runs"] = len(mine)
    return out


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    labels = list(dict.fromkeys(r["variant"] for r in rows))
    keys = [
        ("max_gap_during_s", "max inter-token gap\nwhile registering (s)"),
        ("probe_s", "1-token completion\nsent mid-registration (s)"),
        ("register_s", "POST /v1/schemas (s)"),
    ]
    fig, axes = plt.subplots(1, len(keys), figsize=(11, 3.6))
    for ax, (key, title) in zip(axes, keys):
        for i, label in enumerate(labels):
            vals = [r[key] for r in rows if r["variant"] == label and r.get(key) is not None]
            ax.scatter([i] * len(vals), vals, alpha=0.6)
            if vals:
                med = statistics.median(vals)
                ax.hlines(med, i - 0.25, i + 0.25, colors="k")
                ax.annotate(f"{med:.2f}", (i + 0.28, med), va="center", fontsize=8)
        ax.set_xticks(range(len(labels)), labels)
        ax.set_xlim(-0.6, len(labels) - 0.2)
        ax.set_title(title, fontsize=9)
        ax.set_yscale("log")
    fig.suptitle(
        f"{rows[0]['post_bytes'] // 1000} KB union schema registered while a client streams "
        f"(medians of {max(summary(rows)[label]['runs'] for label in labels)} runs)",
        fontsize=10,
    )
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="default")
    p.add_argument("--members", type=int, default=500)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--before-src", default=None, help="another checkout's src (the 'before' variant)")
    p.add_argument("--lead-tokens", type=int, default=20, help="tokens streamed before the POST")
    p.add_argument("--stream-tokens", type=int, default=4000)
    p.add_argument("--probe-after-s", type=float, default=1.0, help="when the 1-token probe is sent")
    p.add_argument("--serve-arg", action="append", default=[], help="extra kvreuse serve argument (repeat)")
    p.add_argument("--out", default=str(RESULTS / "schema_register.json"))
    args = p.parse_args()
    variants = ([("before", str(Path(args.before_src).resolve()))] if args.before_src else []) + [
        ("after", str(ROOT / "src"))
    ]
    rows: list[dict] = []
    out = Path(args.out)
    for run in range(args.runs):
        for label, src in variants:
            row = run_once(src, label, args, run)
            print(json.dumps(row), flush=True)
            rows.append(row)
            result = {
                "model": args.model,
                "members": args.members,
                "runs": args.runs,
                "serve_args": args.serve_arg,
                "summary": summary(rows),
                "rows": rows,
            }
            write_json(out, result, indent=1)  # after every run: a stopped bench keeps what it measured
    plot(rows, out.with_suffix(".png"))
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
