"""A stream's longest wait while another request's new document is computed (issue 32: context
passes ran outside the scheduler's prefill cap). In process, through ``AsyncEngine`` (the
engine loop the server runs), the default model: one greedy stream decodes; after its
``--after``-th token a documents prompt with a fresh ``--doc-tokens``-token document arrives.
Measured per repetition: the stream's longest inter-token gap and its p50 while the document
was computed, and the document request's TTFT, with the pacer on (the default: the document's
pass runs in chunks of the cap, an engine step between two) and off (``cap`` None: one pass,
as before), interleaved, medians over ``--reps``.

    PYTHONPATH=src .venv/bin/python bench/decode/document_stall.py --reps 5 [--doc-tokens 2048]
    -> bench/results/document_stall[TAG].{json,png}
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, machine, median, pyplot, save_png, write_json
from kvreuse import LLM, SamplingParams
from kvreuse.engine.async_engine import AsyncEngine
from kvreuse.engine.document_cache import DocumentPrompt


async def one_run(engine: AsyncEngine, rng: random.Random, args, rep: int) -> dict:
    """One stream, one document arriving mid-stream; gaps in ms."""
    stream_params = SamplingParams(max_tokens=args.stream_tokens, temperature=0, ignore_eos=True)
    prompt = [rng.randrange(100, 40000) for _ in range(16)]
    document = [rng.randrange(100, 40000) for _ in range(args.doc_tokens)]  # fresh: nothing cached
    doc_prompt = DocumentPrompt.of([([1, 2, 3], False), (document, True), ([7, 8, 9], False)])
    stamps: list[float] = []
    doc_window: list[float] = []

    async def ask_document() -> float:
        t0 = time.perf_counter()
        async for out in engine.generate(
            [], SamplingParams(max_tokens=1, temperature=0), request_id=f"doc{rep}", prepared=doc_prompt
        ):
            if out.finished:
                break
        doc_window.append(time.perf_counter())
        return (time.perf_counter() - t0) * 1e3

    doc_task = None
    async for out in engine.generate(prompt, stream_params, request_id=f"s{rep}"):
        stamps.append(time.perf_counter())
        if len(stamps) == args.after:
            doc_window.append(stamps[-1])
            doc_task = asyncio.create_task(ask_document())
        if out.finished:
            break
    assert doc_task is not None
    ttft = await doc_task
    start, end = doc_window
    gaps = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:]) if b > start and a < end]
    gaps = gaps or [(stamps[-1] - start) * 1e3]
    return {"max_gap_ms": max(gaps), "p50_gap_ms": sorted(gaps)[len(gaps) // 2], "doc_ttft_ms": ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--after", type=int, default=8, help="the stream's token at which the document arrives")
    ap.add_argument("--stream-tokens", type=int, default=400)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    llm = LLM(args.model)
    cap = llm.engine.scheduler.max_prefill_tokens_while_decoding
    engine = AsyncEngine(llm.engine)
    engine.start()
    rng = random.Random(0)
    results: dict[str, list[dict]] = {"pacer on": [], "pacer off": []}
    try:
        for rep in range(args.reps):
            order = ("pacer on", "pacer off") if rep % 2 == 0 else ("pacer off", "pacer on")
            for arm in order:
                llm.engine.pacer.cap = cap if arm == "pacer on" else None
                r = asyncio.run(one_run(engine, rng, args, rep * 2 + (arm == "pacer off")))
                results[arm].append(r)
                print(rep, arm, {k: round(v, 1) for k, v in r.items()}, flush=True)
    finally:
        engine.shutdown()
    summary = {arm: {k: median([r[k] for r in rs]) for k in rs[0]} for arm, rs in results.items()}
    print(summary)
    out = RESULTS / f"document_stall{args.tag}.json"
    write_json(out, {"machine": machine(), "args": vars(args), "cap": cap, "runs": results, "median": summary})
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for x, arm in enumerate(results):
        ys = [r["max_gap_ms"] for r in results[arm]]
        ax.scatter([x] * len(ys), ys, alpha=0.6)
        ax.hlines(summary[arm]["max_gap_ms"], x - 0.2, x + 0.2)
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel("stream's longest gap (ms)")
    ax.set_title(f"a fresh {args.doc_tokens}-token document arriving mid-stream (cap {cap})")
    save_png(fig, out.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
