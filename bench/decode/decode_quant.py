"""Decode speed and resident weight bytes by weight format: fp32, bf16, int8, int4.

    .venv/bin/python bench/decode/decode_quant.py [--model default] [--reps 5] [--tokens 128] [--profile] [--threads N]
    -> bench/results/decode_quant.json, bench/results/decode_quant.png

Default model, CPU, batch 1, greedy, ``--tokens`` decode steps after a short chat prompt. Four
settings, one engine each, loaded side by side and alternated within every repetition (the
order rotating), so machine noise hits them alike:

- ``fp32``: ``--dtype float32 --quantization none`` (the exact reference, today's default);
- ``bf16``: ``--dtype bfloat16 --quantization none``;
- ``int8``: ``--dtype bfloat16 --quantization int8`` (weight-only int8, bf16 activations);
- ``int4``: ``--dtype bfloat16 --quantization int4`` (4-bit, groups of 32; lm_head int8).

Reported: median tok/s over repetitions ((wall - TTFT) / (tokens - 1)), the resident bytes of
each model's parameters and buffers vs the GGUF file it came from, and whether the settings
generated the same tokens as fp32 (not required: quantization changes the math).
``--profile`` adds a torch.profiler table of one decode step at the fastest setting.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from kvreuse import LLM, SamplingParams
from kvreuse.models.loader import load_model, resolve_source
from kvreuse.models.quant import weight_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json

SETTINGS = {
    "fp32": ("float32", "none"),
    "bf16": ("bfloat16", "none"),
    "int8": ("bfloat16", "int8"),
    "int4": ("bfloat16", "int4"),
}
PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper and a storm."}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="profile one decode step at the fastest setting")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llms, sizes = {}, {}
    for name, (dtype, quant) in SETTINGS.items():
        loaded = load_model(args.model, dtype=dtype, quantization=quant)
        sizes[name] = weight_bytes(loaded.model)
        llms[name] = LLM(loaded=loaded, kv_cache_memory_gib=0.1)
    src = resolve_source(args.model)
    gguf_bytes = src.path.stat().st_size if src.path is not None and src.path.suffix == ".gguf" else None
    tok = llms["fp32"].tokenizer
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, dict) else prompt)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    for llm in llms.values():  # warm-up: allocator, kernels, the prompt's blocks
        llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    names = list(SETTINGS)
    rates: dict[str, list[float]] = {n: [] for n in names}
    tokens: dict[str, list[int]] = {}
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            out = llms[name].generate(prompt, params)[0]
            rates[name].append((len(out.token_ids) - 1) / (time.perf_counter() - start - out.ttft_s))
            tokens[name] = out.token_ids
        print(f"rep {rep}: " + "  ".join(f"{n} {rates[n][-1]:5.1f}" for n in names) + " tok/s", flush=True)
    rows = [
        {
            "setting": n,
            "dtype": SETTINGS[n][0],
            "quantization": SETTINGS[n][1],
            "model_id": llms[n].engine.model_id,
            "decode_tok_s": statistics.median(rates[n]),
            "raw_tok_s": rates[n],
            "weight_bytes": sizes[n],
            "weight_bytes_vs_gguf": sizes[n] / gguf_bytes if gguf_bytes else None,
            "same_tokens_as_fp32": tokens[n] == tokens["fp32"],
            "first_diff_vs_fp32": next((i for i, (a, b) in enumerate(zip(tokens[n], tokens["fp32"])) if a != b), None),
        }
        for n in names
    ]
    for r in rows:
        print(
            f"{r['setting']:>5}: {r['decode_tok_s']:6.1f} tok/s  weights {r['weight_bytes'] / 1e6:6.1f} MB"
            + (f" ({r['weight_bytes_vs_gguf']:.2f}x GGUF)" if gguf_bytes else "")
        )
    out = {
        "model": args.model,
        "gguf_file": str(src.path) if gguf_bytes else None,
        "gguf_bytes": gguf_bytes,
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "batch": 1,
        "decode_tokens": args.tokens,
        "prompt_tokens": len(prompt),
        "reps": args.reps,
        "statistic": "median",
        "rows": rows,
    }
    if args.profile:
        best = max(rows, key=lambda r: r["decode_tok_s"])["setting"]
        out["profile"] = {"setting": best, "table": profile_decode(llms[best], prompt)}
        print(out["profile"]["table"])
    write_json(RESULTS / "decode_quant.json", out)
    plot(out, RESULTS / "decode_quant.png")
    print(f"wrote {RESULTS / 'decode_quant.json'} and {RESULTS / 'decode_quant.png'}")


def profile_decode(llm: LLM, prompt: list[int], steps: int = 8) -> str:
    """torch.profiler table (self CPU time) over ``steps`` decode steps; the prompt is cached."""
    from torch.profiler import ProfilerActivity, profile

    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = llm.generate(prompt, SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True))[0]
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    return f"{steps + 1} tokens (1 cached prefill + {steps} decode steps), ttft {out.ttft_s * 1e3:.1f} ms\n{table}"


def plot(out: dict, path: Path) -> None:
    plt = pyplot()

    rows = out["rows"]
    names = [r["setting"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar(names, [r["decode_tok_s"] for r in rows], color="tab:blue")
    a1.set_ylabel("decode tok/s (median, batch 1)")
    a1.set_title("Decode speed by weight format")
    a2.bar(names, [r["weight_bytes"] / 1e6 for r in rows], color="tab:orange")
    if out["gguf_bytes"]:
        a2.axhline(out["gguf_bytes"] / 1e6, color="k", ls="--", label="GGUF file")
        a2.axhline(1.5 * out["gguf_bytes"] / 1e6, color="k", ls=":", label="1.5x GGUF")
        a2.legend()
    a2.set_ylabel("resident weight MB")
    a2.set_title("Weights in memory")
    for ax in (a1, a2):
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"{out['model']}, CPU, {out['threads']} threads (measured under load)")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
