"""Decode step time vs context length: how attention reads the context, side by side.

    .venv/bin/python bench/decode/decode.py [--contexts 512 1024 4096 8000] [--reps 5]
    -> bench/results/decode.json, bench/results/decode.png

One engine, default model, fp32, CPU, batch 1, greedy, 16 decode steps after a cached
prompt of each length. Three variants, switched on the same engine and alternated within
every repetition (the order rotating), so machine noise hits them alike:

- ``transformers+gather``: the transformers forward, every decode in the padded batch whose
  gather copies the whole context each step (the engine before this benchmark's changes);
- ``own+gather``: kvreuse's own Llama forward, still gathering;
- ``own+in-place`` (the default): decodes over 1,024+ context tokens read the pool in place.

Reported: median over repetitions of (wall - TTFT) / decode steps, and that every variant
generated the same tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

from kvreuse import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json

VARIANTS = ("transformers+gather", "own+gather", "own+in-place")
STEPS = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 4096, 8000])
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    llm = LLM(
        args.model, dtype="float32", quantization="none", kv_cache_memory_gib=1.0, max_model_len=max(args.contexts) + 64
    )
    runner = llm.engine.runner
    own, in_place_min = runner._llama, runner.decode_in_place_min
    if own is None:
        raise SystemExit(f"{args.model} does not run the own Llama forward; nothing to compare")
    vocab = llm.tokenizer.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=STEPS + 1, temperature=0, ignore_eos=True)

    def use(variant: str) -> None:
        runner._llama = None if variant.startswith("transformers") else own
        runner.decode_in_place_min = in_place_min if variant.endswith("in-place") else 1 << 30

    rows = []
    for n in args.contexts:
        prompt = [rng.randrange(100, vocab - 100) for _ in range(n)]
        llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))  # cache the prompt
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        tokens: dict[str, list[int]] = {}
        for rep in range(args.reps):
            order = VARIANTS[rep % 3 :] + VARIANTS[: rep % 3]
            for variant in order:
                use(variant)
                start = time.perf_counter()
                out = llm.generate(prompt, params)[0]
                steps = len(out.token_ids) - 1
                times[variant].append((time.perf_counter() - start - out.ttft_s) / steps)
                tokens[variant] = out.token_ids
        use("own+in-place")
        row = {
            "context_tokens": n,
            "steps": STEPS,
            "ms_per_token": {v: statistics.median(t) * 1e3 for v, t in times.items()},
            "same_tokens": all(tokens[v] == tokens[VARIANTS[0]] for v in VARIANTS),
            "raw_ms": {v: [x * 1e3 for x in t] for v, t in times.items()},
        }
        row["speedup_vs_transformers_gather"] = (
            row["ms_per_token"]["transformers+gather"] / row["ms_per_token"]["own+in-place"]
        )
        rows.append(row)
        print(
            f"context {n:>5}: "
            + "  ".join(f"{v} {row['ms_per_token'][v]:6.1f} ms" for v in VARIANTS)
            + f"  same tokens: {row['same_tokens']}",
            flush=True,
        )
    out = {
        "model": llm.engine.model_id,
        "dtype": "float32",
        "device": str(runner.device),
        "batch": 1,
        "reps": args.reps,
        "statistic": "median",
        "decode_in_place_min": in_place_min,
        "rows": rows,
    }
    write_json(RESULTS / "decode.json", out)
    plot(rows, RESULTS / "decode.png")
    print(f"wrote {RESULTS / 'decode.json'} and {RESULTS / 'decode.png'}")


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["context_tokens"] for r in rows]
    for variant in VARIANTS:
        ax.plot(xs, [r["ms_per_token"][variant] for r in rows], marker="o", label=variant)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("ms per decode step (median)")
    ax.set_title("Decode step time, batch 1, SmolLM2-135M fp32, CPU")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
