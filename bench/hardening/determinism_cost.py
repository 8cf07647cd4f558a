"""What deterministic mode costs: cold TTFT and batch-1 decode, the fast forward vs deterministic.

    PYTHONPATH=src .venv/bin/python bench/hardening/determinism_cost.py [--reps 5] [--prompt 2048]
        [--decode 128] [--context 2048]
    -> bench/results/determinism_cost.json, bench/results/determinism_cost.png

One loaded default model (``auto``/``auto``: int4 weights, bf16 activations where the CPU
multiplies bf16 natively), two engines over it: the fast forward (``deterministic=False``,
``--no-deterministic``) and ``deterministic=True`` (the default where kvreuse's kernels build).
The CPU (lscpu model and flags) is recorded with the figures (``write_json``). Arms,
interleaved with the order rotating every repetition (``bench.common.interleave``), so machine
noise hits both engines alike; medians over ``--reps``:

- ``ttft``: cold prefill of a ``--prompt``-token prompt after ``reset_prefix_cache`` (TTFT);
- ``decode``: ``--decode`` greedy tokens after a 16-token prompt, batch 1: (generated - 1) /
  (wall - TTFT);
- ``decode_ctx``: 32 greedy tokens after a cached ``--context``-token prompt (attention's share).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from kvreuse import LLM, SamplingParams
from kvreuse.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, interleave, median, pyplot, save_png, write_json

TEXT = (Path(__file__).resolve().parents[2] / "tests" / "data" / "perplexity_text.txt").read_text()


def prompt_ids(llm: LLM, n: int, salt: int) -> list[int]:
    """``n`` token ids of plain text, starting at a ``salt``-dependent offset (distinct prompts)."""
    ids = llm.tokenizer.encode(TEXT * (n // 400 + 4))
    return ids[salt * 13 : salt * 13 + n]


def ttft(llm: LLM, prompt: list[int]) -> float:
    llm.reset_prefix_cache()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    assert out.num_cached_tokens == 0
    return out.ttft_s


def decode(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Decode tokens/s after ``prompt`` (greedy, EOS ignored)."""
    start = time.perf_counter()
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    wall = time.perf_counter() - start
    return (len(out.token_ids) - 1) / (wall - out.ttft_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    loaded = load_model("default", dtype="auto", device="auto", quantization="auto")
    engines = {
        "fast": LLM(loaded=loaded, kv_cache_memory_gib=0.5, deterministic=False),
        "deterministic": LLM(loaded=loaded, kv_cache_memory_gib=0.5, deterministic=True),
    }
    first = engines["fast"]
    cold, short = prompt_ids(first, args.prompt, 1), prompt_ids(first, 16, 2)
    long_ctx = prompt_ids(first, args.context, 3)
    for llm in engines.values():  # warm up; the long context stays cached for decode_ctx
        decode(llm, short, 8)
        decode(llm, long_ctx, 2)
    arms = {}
    for name, llm in engines.items():
        arms[f"{name}/ttft_s"] = lambda llm=llm: ttft(llm, cold)
        arms[f"{name}/decode_tok_s"] = lambda llm=llm: decode(llm, short, args.decode)
        arms[f"{name}/decode_ctx_tok_s"] = lambda llm=llm: decode(llm, long_ctx, 32)
    samples = interleave(arms, args.reps)
    medians = {k: round(median(v), 4) for k, v in samples.items()}
    ratios = {
        m: round(medians[f"deterministic/{m}"] / medians[f"fast/{m}"], 3)
        for m in ("ttft_s", "decode_tok_s", "decode_ctx_tok_s")
    }
    doc = {
        "settings": vars(args),
        "model": "default",
        "dtype": str(loaded.model.dtype),
        "quantization": str(getattr(loaded, "quantization", None)),
        "medians": medians,
        "deterministic_over_fast": ratios,
        "samples": samples,
    }
    out = write_json(RESULTS / f"determinism_cost{'_' + args.tag if args.tag else ''}.json", doc)
    print({"medians": medians, "deterministic_over_fast": ratios})
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4))
    for ax, (metric, label) in zip(
        axes,
        [
            ("ttft_s", f"cold TTFT, {args.prompt} tokens (s)"),
            ("decode_tok_s", "decode batch 1 (tok/s)"),
            ("decode_ctx_tok_s", f"decode after {args.context} cached (tok/s)"),
        ],
    ):
        vals = [medians[f"{e}/{metric}"] for e in engines]
        ax.bar(list(engines), vals, color=["tab:blue", "tab:orange"])
        ax.set_title(label, fontsize=9)
    title = f"deterministic vs the fast forward, default model ({doc['dtype']}), medians of {args.reps}"
    fig.suptitle(title, fontsize=10)
    save_png(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
