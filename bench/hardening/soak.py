"""Issue 31's mixed soak: 8 concurrent clients against one ``kvreuse serve`` for ``--minutes``,
every greedy answer compared with the same prompt's answer computed alone on the idle server.

    PYTHONPATH=src .venv/bin/python bench/hardening/soak.py [--minutes 10] [--clients 8]
        [--model default] [--[no-]deterministic] [--kv-cache-memory 0.05] [--host-cache-memory 0.1]
        [--max-tokens 32] [--tag NAME]
    -> bench/results/soak[_TAG].json, bench/results/soak[_TAG].png, a summary on stdout

The prompts: 12 fixed texts of varied length, five of them one ~650-token document with
different questions (so they hit each other's prefix), three short, four long documents of their
own (~800 tokens: with the default 0.05 GiB pool, ~2,300 tokens, they push the others out to
the host tier). Each prompt goes as a chat and as a completions request: 24 greedy
(temperature 0, ``ignore_eos``, ``--max-tokens``) references, each computed alone after
``/reset_prefix_cache`` (a miss), then once more at once (a hit, alone: recorded, not the
reference).

Then every client loops until the deadline; a request is, at random: greedy (82%; half of them
streamed) compared with its reference, sampled (10%; temperature 0.8, not compared) or a bad
request (8%; a ``top_p`` that is 0 in fp32, a negative temperature or max_tokens, a wrong type:
400 expected). Failed: a 5xx, a transport error, an error event or a stream without ``[DONE]``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, free_port, pyplot, running_server, save_png, write_json

PLACES = ["Aldermere", "Brackwater", "Cindervale", "Dunmoor", "Elmstead", "Fallowby", "Greywick", "Harrowgate"]
KINDS = ["marsh", "forest", "valley", "harbour", "ridge", "orchard", "quarry", "mill"]
BAD: list[tuple[str, dict[str, Any]]] = [  # (what, fields over a valid body): each should be a 400
    ("top_p 5e-324 (0 in fp32)", {"top_p": 5e-324, "temperature": 1.0}),
    ("temperature -1", {"temperature": -1.0}),
    ("max_tokens -3", {"max_tokens": -3}),
    ("n 'two'", {"n": "two"}),
    ("top_k -2", {"top_k": -2, "temperature": 1.0}),
]


def paragraph(rng: random.Random) -> str:
    place, kind = rng.choice(PLACES), rng.choice(KINDS)
    a, b, c = rng.sample(PLACES, 3)
    return (
        f"The {kind} of {place} lies {rng.randrange(3, 90)} miles north of {a}. "
        f"It was first mapped in {rng.randrange(1600, 1900)} by a surveyor from {b}, who counted "
        f"{rng.randrange(20, 900)} houses along its edge. "
        f"Today about {rng.randrange(2, 60)} thousand people visit it each year, most of them in spring, "
        f"and the road from {c} is the easiest way in."
    )


def document(seed: int, paragraphs: int) -> str:
    rng = random.Random(seed)
    return "\n\n".join(paragraph(rng) for _ in range(paragraphs))


def make_prompts() -> list[str]:
    """The 12 fixed prompts: 5 sharing one long document, 3 short, 4 long ones of their own."""
    shared = document(1, 9)
    questions = [
        "Which place was mapped earliest, and by whom?",
        "List every harbour mentioned, with its distance.",
        "Which place has the most visitors each year?",
        "Summarise the text in three sentences.",
        "Which roads are named as the easiest way in?",
    ]
    short = [
        "Write a haiku about a lighthouse.",
        "What is the capital of France? Explain briefly.",
        "Count from one to twenty in words, separated by commas.",
    ]
    own = [document(100 + i, 10) + "\n\nWhich place was mapped latest, and by whom?" for i in range(4)]
    return [shared + "\n\n" + q for q in questions] + short + own


def body(
    kind: str, model: str, prompt: str, max_tokens: int, stream: bool, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A greedy request body; ``extra`` fields replace or add to it."""
    b: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if kind == "chat":
        b["messages"] = [{"role": "user", "content": prompt}]
    else:
        b["prompt"] = prompt
    if stream:
        b["stream"] = True
        b["stream_options"] = {"include_usage": True}
    b.update(extra or {})
    return b


def call(client: httpx.Client, url: str, kind: str, b: dict[str, Any]) -> dict[str, Any]:
    """One request: ``{status, text, cached, error}``; ``error`` set on a transport error, an
    error event or a stream cut before ``[DONE]``."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    out: dict[str, Any] = {"status": None, "text": None, "cached": None, "error": None}
    try:
        if not b.get("stream"):
            r = client.post(url + path, json=b)
            out["status"] = r.status_code
            if r.status_code == 200:
                doc = r.json()
                choice = doc["choices"][0]
                out["text"] = choice["message"]["content"] if kind == "chat" else choice["text"]
                out["cached"] = (doc.get("usage") or {}).get("prompt_tokens_details", {}).get("cached_tokens")
            return out
        with client.stream("POST", url + path, json=b) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                r.read()
                return out
            parts, done = [], False
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out["error"] = f"error event: {str(event['error'])[:200]}"
                    return out
                for choice in event.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") if kind == "chat" else choice.get("text")
                    parts.append(piece or "")
                if event.get("usage"):
                    out["cached"] = (event["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
            if not done:
                out["error"] = "stream ended without [DONE]"
            out["text"] = "".join(parts)
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc!s:.200}"
    return out


def references(url: str, model: str, prompts: list[str], max_tokens: int) -> tuple[dict, dict, list]:
    """Each (kind, prompt)'s greedy text alone after ``/reset_prefix_cache`` (the reference), and
    again at once (a hit, alone); returns (reference, hit_alone, per-reference records)."""
    ref: dict[tuple[str, int], str] = {}
    hit: dict[tuple[str, int], str] = {}
    records = []
    with httpx.Client(timeout=600) as client:
        for kind in ("chat", "completions"):
            for i, p in enumerate(prompts):
                client.post(url + "/reset_prefix_cache").raise_for_status()
                miss = call(client, url, kind, body(kind, model, p, max_tokens, False))
                again = call(client, url, kind, body(kind, model, p, max_tokens, False))
                if miss["status"] != 200 or again["status"] != 200:
                    raise RuntimeError(f"reference {kind} {i}: {miss} / {again}")
                ref[kind, i], hit[kind, i] = miss["text"], again["text"]
                records.append(
                    {
                        "kind": kind,
                        "prompt": i,
                        "miss_cached": miss["cached"],
                        "hit_cached": again["cached"],
                        "hit_alone_differs": again["text"] != miss["text"],
                    }
                )
    return ref, hit, records


def client_loop(
    url: str, model: str, prompts: list[str], ref: dict, args: argparse.Namespace, seed: int, deadline: float, log: list
) -> None:
    rng = random.Random(seed)
    with httpx.Client(timeout=args.request_timeout) as client:
        while time.monotonic() < deadline:
            kind = rng.choice(("chat", "completions"))
            i = rng.randrange(len(prompts))
            stream = rng.random() < 0.5
            r = rng.random()
            if r < 0.08:
                what, extra = rng.choice(BAD)
                category = "bad"
                b = body(kind, model, prompts[i], args.max_tokens, stream, extra)
            elif r < 0.18:
                what, category = "temperature 0.8", "sampled"
                b = body(kind, model, prompts[i], args.max_tokens, stream, {"temperature": 0.8})
            else:
                what, category = "greedy", "greedy"
                b = body(kind, model, prompts[i], args.max_tokens, stream)
            t0 = time.monotonic()
            res = call(client, url, kind, b)
            rec = {
                "t": round(t0 - (deadline - args.minutes * 60), 2),
                "s": round(time.monotonic() - t0, 3),
                "category": category,
                "what": what,
                "kind": kind,
                "prompt": i,
                "stream": stream,
                "status": res["status"],
                "cached": res["cached"],
                "error": res["error"],
                "differs": None,
            }
            if category == "greedy" and res["status"] == 200 and res["error"] is None:
                rec["differs"] = res["text"] != ref[kind, i]
                if rec["differs"]:
                    rec["text"] = res["text"]
            log.append(rec)


def summarise(log: list[dict]) -> dict[str, Any]:
    failed = [r for r in log if r["error"] is not None or r["status"] is None or r["status"] >= 500]
    greedy = [r for r in log if r["differs"] is not None]
    differing = [r for r in greedy if r["differs"]]
    bad = [r for r in log if r["category"] == "bad"]
    return {
        "requests": len(log),
        "failed": len(failed),
        "failures": [{k: r[k] for k in ("t", "category", "kind", "stream", "status", "error")} for r in failed[:20]],
        "by_category": dict(Counter(r["category"] for r in log)),
        "status_codes": {str(k): v for k, v in Counter(r["status"] for r in log).items()},
        "bad_requests": len(bad),
        "bad_answered_400": sum(r["status"] == 400 for r in bad),
        "bad_other_status": dict(Counter(f"{r['what']}: {r['status']}" for r in bad if r["status"] != 400)),
        "status_400_total": sum(r["status"] == 400 for r in log),
        "greedy_compared": len(greedy),
        "greedy_with_cache_hit": sum(bool(r["cached"]) for r in greedy),
        "greedy_differing": len(differing),
        "greedy_differing_distinct_prompts": len({(r["kind"], r["prompt"]) for r in differing}),
        "greedy_differing_by_prompt": dict(Counter(f"{r['kind']}:{r['prompt']}" for r in differing)),
        "latency_s_median": {
            c: round(sorted(x)[len(x) // 2], 2)
            for c in ("greedy", "sampled")
            if (x := [r["s"] for r in log if r["category"] == c and r["status"] == 200])
        },
    }


def plot(log: list[dict], summary: dict, title: str, path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    styles = [
        ("greedy, same as reference", lambda r: r["differs"] is False, "tab:green", "."),
        ("greedy, differs", lambda r: r["differs"] is True, "tab:red", "x"),
        ("sampled", lambda r: r["category"] == "sampled", "tab:blue", "."),
        ("bad request", lambda r: r["category"] == "bad", "tab:gray", "v"),
        ("failed", lambda r: r["error"] is not None or (r["status"] or 500) >= 500, "black", "*"),
    ]
    for label, pick, color, marker in styles:
        pts = [r for r in log if pick(r)]
        ax.scatter(
            [r["t"] for r in pts], [r["s"] for r in pts], s=12, c=color, marker=marker, label=f"{label} ({len(pts)})"
        )
    ax.set_xlabel("request start (s into the soak)")
    ax.set_ylabel("request seconds")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    names = ["requests", "failed", "status_400_total", "greedy_compared", "greedy_with_cache_hit", "greedy_differing"]
    bx.barh(names, [summary[n] for n in names], color="tab:purple")
    for y, n in enumerate(names):
        bx.text(summary[n], y, f" {summary[n]}", va="center", fontsize=8)
    bx.invert_yaxis()
    bx.set_title("counts", fontsize=9)
    fig.tight_layout()
    save_png(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--model", default="default")
    ap.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="kvreuse serve --deterministic / --no-deterministic (default: neither, the server's default)",
    )
    ap.add_argument("--kv-cache-memory", type=float, default=0.05, help="GiB (small: the long prompts evict)")
    ap.add_argument("--host-cache-memory", type=float, default=0.1, help="GiB (0: no host tier)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=12, help="the first N of the 12 prompts (fewer: a quick try)")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="", help="results go to soak[_TAG].json/png")
    args = ap.parse_args()
    prompts = make_prompts()[: args.prompts]
    serve_args = [
        "--model",
        args.model,
        "--kv-cache-memory",
        str(args.kv_cache_memory),
        "--host-cache-memory",
        str(args.host_cache_memory),
    ]
    if args.deterministic is not None:
        serve_args.append("--deterministic" if args.deterministic else "--no-deterministic")
    logs = Path(tempfile.mkdtemp(prefix="soak-"))
    t_start = time.monotonic()
    with running_server(free_port(), serve_args, logs / "serve.log", startup_s=600) as url:
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        resolved = httpx.get(url + "/v1/kvreuse/info", timeout=30).json().get("deterministic")
        t0 = time.monotonic()
        ref, _hit, ref_records = references(url, model, prompts, args.max_tokens)
        ref_s = time.monotonic() - t0
        print(
            f"references: {len(ref)} in {ref_s:.0f} s; hit alone differs: "
            f"{sum(r['hit_alone_differs'] for r in ref_records)}",
            flush=True,
        )
        log: list[dict] = []
        deadline = time.monotonic() + args.minutes * 60
        threads = [
            threading.Thread(
                target=client_loop, args=(url, model, prompts, ref, args, args.seed * 100 + c, deadline, log)
            )
            for c in range(args.clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        soak_s = time.monotonic() - deadline + args.minutes * 60
        health = httpx.get(url + "/health", timeout=30).status_code
    summary = summarise(log)
    mode = {None: "default", True: "deterministic", False: "no-deterministic"}[args.deterministic]
    doc = {
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "tag"},
            "mode": mode,
            "deterministic": resolved,  # what the server resolved (/v1/kvreuse/info)
            "serve_args": serve_args,
            "prompt_chars": [len(p) for p in prompts],
            "mix": "82% greedy (half streamed), 10% sampled T=0.8, 8% bad requests",
        },
        "references": {"count": len(ref), "seconds": round(ref_s, 1), "records": ref_records},
        "hit_alone_differs": sum(r["hit_alone_differs"] for r in ref_records),
        "soak_seconds": round(soak_s, 1),
        "health_after": health,
        "total_seconds": round(time.monotonic() - t_start, 1),
        "summary": summary,
        "requests": log,
    }
    suffix = f"_{args.tag}" if args.tag else ""
    write_json(RESULTS / f"soak{suffix}.json", doc, indent=1)
    title = f"soak, {mode}: {args.clients} clients, {args.minutes:g} min, {args.model}, kv {args.kv_cache_memory} GiB"
    plot(log, summary, title, RESULTS / f"soak{suffix}.png")
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1))
    if summary["failures"]:
        print("failures:", json.dumps(summary["failures"], indent=1))
    print(f"health after: {health}; server log {logs / 'serve.log'}")


if __name__ == "__main__":
    main()
