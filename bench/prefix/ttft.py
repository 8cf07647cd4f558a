"""TTFT of a cached prefix + a 32-token new suffix vs the same prompt uncached, and cold
prefill throughput of kvreuse vs a plain transformers forward, side by side in one run.

    .venv/bin/python bench/prefix/ttft.py [--sizes 512 2048 4096 8192] [--reps 5] [--model default]
        [--dtype float32|bfloat16|auto] [--quantization none|auto|int8|int4] [--out PATH]

Writes bench/results/ttft.json and bench/results/ttft.png. Every repetition measures all
three variants for every size back to back (interleaved), so machine noise hits them alike;
the cheap cached request runs ``--cached-per-rep`` times per repetition (new suffix each),
so its median is over reps x that many samples; figures are medians.
"""

from __future__ import annotations

import argparse
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

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0)


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    ap.add_argument("--suffix", type=int, default=32)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--dtype",
        default="float32",
        help="float32 (the issue's setting), bfloat16 or auto (CPUs with native bf16: AMX or avx512_bf16)",
    )
    ap.add_argument(
        "--quantization",
        default="none",
        help="none (the issue's setting) or auto|int8|int4; "
        "--dtype auto --quantization auto is kvreuse serve's default",
    )
    ap.add_argument(
        "--cached-per-rep",
        type=int,
        default=3,
        help="cached requests per repetition, each with a new suffix (cheap; steadies the median)",
    )
    ap.add_argument("--out", default=str(RESULTS / "ttft.json"))
    args = ap.parse_args()

    loaded = load_model(args.model, dtype=args.dtype, device="cpu", quantization=args.quantization)
    # The baseline gets its own copy with transformers' own SDPA attention: nothing kvreuse
    # registers or changes on its model can touch "plain".
    plain_model = load_model(
        args.model, dtype=args.dtype, device="cpu", attn_implementation="sdpa", quantization=args.quantization
    ).model
    vocab = loaded.shape.vocab_size
    max_len = max(args.sizes) + args.suffix + 16
    gib = 2 * max_len * loaded.kv_bytes_per_token() / 2**30 + 0.05
    common = dict(loaded=loaded, kv_cache_memory_gib=gib, max_model_len=max(max_len, loaded.shape.max_model_len))
    cached = LLM(**common)
    uncached = LLM(enable_prefix_caching=False, **common)
    rng = random.Random(0)
    prefixes = {n: random_tokens(rng, n, vocab) for n in args.sizes}
    for prefix in prefixes.values():  # warm the cache: one request per prefix
        cached.generate(prefix + random_tokens(rng, args.suffix, vocab), ONE_TOKEN)

    rows: dict[int, dict[str, list[float]]] = {
        n: {"cached": [], "uncached": [], "plain": [], "hit": []} for n in args.sizes
    }
    for rep in range(args.reps):
        for n in args.sizes:
            prompt = prefixes[n] + random_tokens(rng, args.suffix, vocab)

            def run_uncached() -> None:
                rows[n]["uncached"].append(uncached.generate(prompt, ONE_TOKEN)[0].ttft_s)

            def run_plain() -> None:
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    plain_model(input_ids=torch.tensor([prompt]), logits_to_keep=1)
                    rows[n]["plain"].append(time.perf_counter() - t0)

            # Alternate which long prefill goes first (ABBA), so what one leaves in caches
            # and memory does not always favour the other.
            first, last = (run_uncached, run_plain) if rep % 2 == 0 else (run_plain, run_uncached)
            first()
            for j in range(args.cached_per_rep):
                # a new suffix each time, so each request computes its 32 tokens afresh
                suffix_prompt = prompt if j == 0 else prefixes[n] + random_tokens(rng, args.suffix, vocab)
                out = cached.generate(suffix_prompt, ONE_TOKEN)[0]
                rows[n]["cached"].append(out.ttft_s)
                rows[n]["hit"].append(out.num_cached_tokens)
            last()
            print(
                f"rep {rep} n={n}: uncached {rows[n]['uncached'][-1]:.3f}s cached {rows[n]['cached'][-1] * 1e3:.1f}ms "
                f"(hit {out.num_cached_tokens}) plain transformers {rows[n]['plain'][-1]:.3f}s",
                flush=True,
            )

    summary = []
    for n in args.sizes:
        med = {k: statistics.median(v) for k, v in rows[n].items()}
        total = n + args.suffix
        summary.append(
            {
                "prefix_tokens": n,
                "prompt_tokens": total,
                "cached_tokens_median": med["hit"],
                "ttft_cached_s": med["cached"],
                "ttft_uncached_s": med["uncached"],
                "speedup_cached_vs_uncached": med["uncached"] / med["cached"],
                "plain_transformers_prefill_s": med["plain"],
                "kvreuse_cold_prefill_tok_per_s": total / med["uncached"],
                "plain_transformers_prefill_tok_per_s": total / med["plain"],
                "cold_prefill_ratio_kvreuse_over_plain": med["plain"] / med["uncached"],
                "raw": rows[n],
            }
        )
    doc = {
        "model": loaded.name,
        "model_id": loaded.model_id,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "device": "cpu",
        "torch_threads": torch.get_num_threads(),
        "suffix_tokens": args.suffix,
        "reps": args.reps,
        "cached_per_rep": args.cached_per_rep,
        "results": summary,
    }
    out_path = Path(args.out)
    write_json(out_path, doc)
    setting = args.dtype if args.quantization == "none" else f"{args.dtype}/{args.quantization}"
    plot(summary, out_path.with_suffix(".png"), loaded.name, setting)
    for s in summary:
        print(
            f"{s['prefix_tokens']:>5} + {args.suffix}: cached {s['ttft_cached_s'] * 1e3:7.1f} ms  uncached "
            f"{s['ttft_uncached_s']:6.2f} s  speedup {s['speedup_cached_vs_uncached']:6.1f}x  cold prefill "
            f"kvreuse/plain {s['cold_prefill_ratio_kvreuse_over_plain']:.2f}"
        )
    print(f"wrote {out_path} and {out_path.with_suffix('.png')}")


def plot(summary: list[dict], path: Path, model_name: str, dtype: str = "float32") -> None:
    plt = pyplot()

    sizes = [s["prefix_tokens"] for s in summary]
    x = range(len(sizes))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    w = 0.27
    ax.bar(
        [i - w for i in x], [s["plain_transformers_prefill_s"] for s in summary], w, label="plain transformers prefill"
    )
    ax.bar(list(x), [s["ttft_uncached_s"] for s in summary], w, label="kvreuse uncached")
    ax.bar([i + w for i in x], [s["ttft_cached_s"] for s in summary], w, label="kvreuse cached prefix")
    for i, s in zip(x, summary):
        ax.annotate(f"{s['speedup_cached_vs_uncached']:.0f}x", (i + w, s["ttft_cached_s"]), ha="center", va="bottom")
    ax.set_yscale("log")
    ax.set_xticks(list(x), [f"{n} + 32" for n in sizes])
    ax.set_xlabel("prompt tokens (cached prefix + new suffix)")
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title(f"TTFT, {model_name} {dtype} CPU, medians")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
