"""Prefill and decode of a quantized model: kvreuse's many-row dense path vs the old rule.

    PYTHONPATH=src .venv/bin/python bench/quant/quant_prefill.py [--reps 5] \\
        [--configs bfloat16:2000,float32:256] [--quantization int4]
    -> bench/results/quant_prefill<tag>.json, .png

The default model quantized (``--quantization``, int4 by default: what ``auto`` gives its Q4_1
GGUF with bf16; named explicitly because ``auto`` with float32 is no quantization) in each
``dtype:tokens`` config. Per rep, interleaved, each rule times: TTFT of a fresh ``tokens``-token prompt
(max_tokens=1, a new ``cache_salt``), and 16 greedy decode steps at batch 1. Rules:
``new`` is ``quant.dense_dtype`` as shipped; ``old`` is the rule before it (a bf16 call of 160
or more rows multiplies a bf16 dequantized copy, everything else calls the int kernel), patched
in for the run. On a CPU without native bf16 (``cpu_has_fast_bf16`` false) the two differ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from kvreuse import LLM, SamplingParams
from kvreuse.models import quant
from kvreuse.models.quant import dense_rule

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json


def old_rule(rows: int, x_dtype: torch.dtype) -> torch.dtype | None:
    return torch.bfloat16 if x_dtype == torch.bfloat16 and rows >= quant.DENSE_MIN_ROWS else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--configs", default="bfloat16:2000,float32:256", help="dtype:prompt_tokens,...")
    ap.add_argument("--quantization", default="int4", choices=["int4", "int8"])
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    rules = {"new": quant.dense_dtype, "old": old_rule}
    result = {
        "model": args.model,
        "cpu_has_fast_bf16": quant.fast_bf16_cpu(),
        "threads": torch.get_num_threads(),
        "reps": args.reps,
        "configs": {},
    }
    for config in args.configs.split(","):
        dtype, tokens = config.split(":")
        llm = LLM(args.model, dtype=dtype, quantization=args.quantization, kv_cache_memory_gib=1.0)
        quantized = llm.engine.loaded.quantization.value
        if quantized != args.quantization:
            raise SystemExit(f"{config}: loaded with quantization {quantized}, not {args.quantization}")
        prompt = [1 + (7 * i) % 4000 for i in range(int(tokens))]
        short = [1 + (11 * i) % 4000 for i in range(8)]
        samples = {r: {"ttft_s": [], "decode_tok_s": []} for r in rules}
        for rep in range(args.reps):
            for name, rule in rules.items():
                dense_rule.dense_dtype = rule  # Int4Linear / Int8Linear read it from there at call time
                try:
                    out = llm.generate(prompt, SamplingParams(max_tokens=1), cache_salt=f"{name}-{rep}-{time.time()}")
                    samples[name]["ttft_s"].append(out[0].ttft_s)
                    t0 = time.perf_counter()
                    out = llm.generate(
                        short,
                        SamplingParams(max_tokens=17, temperature=0, ignore_eos=True),
                        cache_salt=f"d-{name}-{rep}-{time.time()}",
                    )
                    steps = len(out[0].token_ids) - 1
                    samples[name]["decode_tok_s"].append(steps / (time.perf_counter() - t0 - out[0].ttft_s))
                finally:
                    dense_rule.dense_dtype = rules["new"]
            print(config, rep, {n: {k: round(v[-1], 3) for k, v in s.items()} for n, s in samples.items()}, flush=True)
        med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
        result["configs"][config] = {
            "dtype": dtype,
            "prompt_tokens": int(tokens),
            "model_id": llm.engine.model_id,
            "quantization": quantized,
            "median": med,
            "samples": samples,
            "ttft_old_over_new": med["old"]["ttft_s"] / med["new"]["ttft_s"],
        }
        print(config, json.dumps(result["configs"][config]["median"]), flush=True)
        llm.engine.close()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"quant_prefill{args.tag}.json"
    write_json(out, result)

    plt = pyplot()

    names = list(result["configs"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT, s (log)"), (axes[1], "decode_tok_s", "decode, tokens/s")):
        for j, rule in enumerate(rules):
            vals = [result["configs"][c]["median"][rule][key] for c in names]
            ax.bar([i + 0.4 * j for i in range(len(names))], vals, width=0.4, label=f"{rule} rule")
        ax.set_xticks([i + 0.2 for i in range(len(names))], [f"{c} tokens" for c in names], fontsize=8)
        ax.set_ylabel(label)
        if key == "ttft_s":
            ax.set_yscale("log")
        ax.legend(fontsize=8)
    cpu = "native bf16" if result["cpu_has_fast_bf16"] else "no native bf16"
    fig.suptitle(f"{args.model}, {args.quantization}, {cpu}, median of {args.reps}", fontsize=9)
    fig.tight_layout()
    save_png(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
