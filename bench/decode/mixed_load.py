"""Decode under other requests' prefill, in process: the inter-token latency of streams while
new requests keep arriving, for several caps on the prefill tokens a decoding step may carry
(``--max-prefill-tokens-while-decoding``; issue 32 item 3).

The load is the issue's: C clients, each sending R requests in a row, every prompt a shared
system prompt (cached after the first) plus U new tokens, O tokens out, greedy. Arms run
interleaved; the figures are pooled over the rounds. A lone stream's ITL at the same context is
measured in every round as the reference.

    PYTHONPATH=src .venv/bin/python bench/decode/mixed_load.py --caps 0 16 32 64 128 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, machine, pyplot, save_png, write_json
from kvreuse import LLM, SamplingParams


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_load(llm: LLM, cap: int | None, args, rng: random.Random, system: list[int]) -> dict:
    """One load run; returns ITLs (ms), TTFTs (ms) and output tok/s."""
    engine = llm.engine
    engine.scheduler.max_prefill_tokens_while_decoding = cap
    engine.scheduler.prefill_tokens_per_decode = 0  # each arm a fixed cap (the default grows it per stream)
    params = SamplingParams(max_tokens=args.out, temperature=0, ignore_eos=True)
    queues = {c: args.requests for c in range(args.clients)}
    last: dict[str, float] = {}
    start: dict[str, float] = {}
    owner: dict[str, int] = {}
    itl: list[float] = []
    ttft: list[float] = []
    n = 0
    tokens = 0
    t0 = time.perf_counter()

    def submit(client: int) -> None:
        nonlocal n
        rid = f"c{client}-{n}"
        n += 1
        prompt = system + [rng.randrange(100, 40000) for _ in range(args.user)]
        engine.add_request(rid, prompt, params)
        start[rid] = time.perf_counter()
        owner[rid] = client
        queues[client] -= 1

    # Staggered starts: client c sends its first request after c * out / clients steps. Started
    # together, the clients' requests prefilled together (no decode beside them, so no cap applied),
    # decoded together and finished together, and no step ever mixed a prefill with decodes.
    pending = {c * args.out // args.clients: c for c in range(args.clients)}
    steps = 0
    while pending or engine.has_unfinished_requests():
        if steps in pending:
            submit(pending.pop(steps))
        steps += 1
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            rid = out.request_id
            k = len(out.new_token_ids)
            tokens += k
            if rid in last:
                itl.append((now - last[rid]) * 1e3 / max(k, 1))
            else:
                ttft.append((now - start[rid]) * 1e3)
            last[rid] = now
            if out.finished and queues[owner[rid]] > 0:
                submit(owner[rid])
    wall = time.perf_counter() - t0
    return {"itl_ms": itl, "ttft_ms": ttft, "tok_s": tokens / wall}


def lone_itl(llm: LLM, args, rng: random.Random, system: list[int]) -> float:
    engine = llm.engine
    prompt = system + [rng.randrange(100, 40000) for _ in range(args.user)]
    engine.add_request("lone", prompt, SamplingParams(max_tokens=args.out, temperature=0, ignore_eos=True))
    stamps = []
    while engine.has_unfinished_requests():
        if engine.step():
            stamps.append(time.perf_counter())
    gaps = [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:])]
    return sorted(gaps)[len(gaps) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--caps", type=int, nargs="+", default=[0, 16, 32, 64, 128], help="0: no cap")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=3, help="requests each client sends in a row")
    ap.add_argument("--system", type=int, default=1500)
    ap.add_argument("--user", type=int, default=128)
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    llm = LLM(args.model)
    rng = random.Random(0)
    system = [rng.randrange(100, 40000) for _ in range(args.system)]
    llm.generate([system], SamplingParams(max_tokens=1, temperature=0))  # the shared prompt cached
    pooled: dict[int, dict[str, list[float]]] = {c: {"itl_ms": [], "ttft_ms": [], "tok_s": []} for c in args.caps}
    lone: list[float] = []
    for r in range(args.rounds):
        lone.append(lone_itl(llm, args, rng, system))
        for cap in args.caps if r % 2 == 0 else list(reversed(args.caps)):
            res = run_load(llm, cap or None, args, rng, system)
            for key in ("itl_ms", "ttft_ms"):
                pooled[cap][key] += res[key]
            pooled[cap]["tok_s"].append(res["tok_s"])
            print(
                f"round {r} cap {cap or 'none'}: ITL p50 {percentile(res['itl_ms'], 0.5):.1f} "
                f"p99 {percentile(res['itl_ms'], 0.99):.1f} ms, TTFT p50 {percentile(res['ttft_ms'], 0.5):.0f} ms, "
                f"{res['tok_s']:.1f} tok/s",
                flush=True,
            )
        llm.engine.check_integrity()
    lone_ms = sorted(lone)[len(lone) // 2]
    rows = {}
    for cap in args.caps:
        p = pooled[cap]
        rows[str(cap or "none")] = {
            "itl_p50_ms": percentile(p["itl_ms"], 0.5),
            "itl_p99_ms": percentile(p["itl_ms"], 0.99),
            "ttft_p50_ms": percentile(p["ttft_ms"], 0.5),
            "tok_s": sorted(p["tok_s"])[len(p["tok_s"]) // 2],
            "itl_p50_x_lone": percentile(p["itl_ms"], 0.5) / lone_ms,
            "itl_p99_x_lone": percentile(p["itl_ms"], 0.99) / lone_ms,
        }
    doc = {"machine": machine(), "args": vars(args), "lone_itl_ms": lone_ms, "by_cap": rows}
    print(f"lone stream ITL {lone_ms:.1f} ms")
    for cap, row in rows.items():
        print(
            f"cap {cap:>5}: p50 {row['itl_p50_ms']:.1f} ms ({row['itl_p50_x_lone']:.2f}x) p99 {row['itl_p99_ms']:.1f} "
            f"ms ({row['itl_p99_x_lone']:.2f}x) TTFT p50 {row['ttft_p50_ms']:.0f} ms {row['tok_s']:.1f} tok/s"
        )
    out = RESULTS / f"mixed_load{args.tag}.json"
    write_json(out, doc)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    caps = list(rows)
    ax.plot(caps, [rows[c]["itl_p50_ms"] for c in caps], "o-", label="ITL p50")
    ax.plot(caps, [rows[c]["itl_p99_ms"] for c in caps], "s-", label="ITL p99")
    ax.axhline(lone_ms, color="gray", ls="--", label="lone stream")
    ax.set_xlabel("prefill tokens per decoding step (cap)")
    ax.set_ylabel("ms")
    ax.set_title(f"{args.clients} clients, shared {args.system}-token prompt + {args.user} new, {args.out} out")
    ax.legend()
    save_png(fig, out.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
