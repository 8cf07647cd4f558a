"""8-bit KV (``--kv-cache-dtype int8`` / ``fp8`` / ``fp8_e5m2``) against bf16 KV on one model:
quality and decode speed.

    nice -n 19 .venv/bin/python bench/kv/kv_cache_dtype.py [--model default] [--part quality|speed|all]
        [--arms int8,fp8]
    -> bench/results/kv_cache_dtype.json, bench/results/kv_cache_dtype.png

Engines share one loaded model (the serving default: ``dtype`` and ``quantization`` auto): ``auto``
with the pool in the model's dtype, and one per ``--arms`` format (rows of 8-bit values and one
bf16 scale per token and KV head), all measured in the same run.

- quality: the shipped text (tests/data/perplexity_text.txt) run through each engine's own pool in
  chunks of 128 tokens, every chunk attending to the earlier chunks' K/V as the pool holds them:
  perplexity over the text once, and each arm's top-1 agreement with the bf16-KV engine at every position of
  the text four times over (``--agreement-repeats``: a fixed set of ~2,100 positions whose context
  reaches ~2,000 keys on the default model; 1 for a large vocabulary such as Gemma 3's);
- speed: a 4,096-token prompt cached, then decode of 32 tokens after it (ms per token,
  (wall - TTFT) / 32) and the TTFT of that cached prompt (+ 1 token: all but the last partial block
  are hits), arms interleaved each repetition (bench.common.interleave).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from pathlib import Path

import torch

from kvreuse import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, interleave, median, pyplot, save_png, write_json
from kvreuse.engine.seq_chunk import SeqChunk

TEXT = (Path(__file__).resolve().parents[2] / "tests" / "data" / "perplexity_text.txt").read_text()
CHUNK = 128
COLORS = {"auto": "#777", "int8": "#2a7", "fp8": "#27a", "fp8_e4m3": "#27a", "fp8_e5m2": "#a72"}


def logits_over(llm: LLM, ids: list[int]) -> torch.Tensor:
    """``[len(ids), vocab]`` fp32: token ``i``'s next-token logits with every key read from ``llm``'s
    pool (slots 0..n-1), ``CHUNK`` new tokens a pass."""
    runner = llm.engine.runner
    slots = list(range(len(ids)))
    rows = []
    for s in range(0, len(ids), CHUNK):
        e = min(s + CHUNK, len(ids))
        chunk = SeqChunk.from_slots(ids[s:e], slots[s:e], slots[s:e], slots[:s], None, sample=True)
        rows.append(runner.execute([dataclasses.replace(chunk, num_logits=e - s)]))
    return torch.cat(rows)  # [n, vocab]


def quality(llms: dict[str, LLM], repeat: int) -> dict:
    tok = llms["auto"].tokenizer
    once = tok(TEXT).input_ids
    many = tok(TEXT * repeat).input_ids
    out: dict = {"text_tokens": len(once), "agreement_positions": len(many) - 1, "agreement_text_repeats": repeat}
    top1 = {}
    for name, llm in llms.items():
        logits = logits_over(llm, once)
        nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(once[1:]), reduction="mean").item()
        out[f"perplexity_{name}"] = math.exp(nll)
        top1[name] = (logits if repeat == 1 else logits_over(llm, many))[:-1].argmax(-1)
        del logits
        print(f"{name}: perplexity {out[f'perplexity_{name}']:.4f}", flush=True)
    for name in llms:
        if name == "auto":
            continue
        out[f"perplexity_ratio_{name}"] = out[f"perplexity_{name}"] / out["perplexity_auto"]
        out[f"top1_agreement_{name}"] = (top1[name] == top1["auto"]).float().mean().item()
        print(
            f"{name}: top-1 agreement with auto over {out['agreement_positions']} positions: "
            f"{out[f'top1_agreement_{name}']:.4f}, perplexity x{out[f'perplexity_ratio_{name}']:.4f}",
            flush=True,
        )
    return out


def speed(llms: dict[str, LLM], context: int, reps: int) -> dict:
    vocab = llms["auto"].tokenizer.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab - 100) for _ in range(context)]
    decode = SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0)
    tokens: dict[str, list[int]] = {}
    for llm in llms.values():
        llm.generate(prompt, one)  # cache the prompt

    def arm(name: str):
        def run() -> tuple[float, float]:
            start = time.perf_counter()
            out = llms[name].generate(prompt, decode)[0]
            wall = time.perf_counter() - start
            tokens[name] = out.token_ids
            assert out.num_cached_tokens >= context - llms[name].engine.block_size
            return (wall - out.ttft_s) / (len(out.token_ids) - 1), out.ttft_s

        return run

    samples = interleave({name: arm(name) for name in llms}, reps)
    rows = {
        name: {
            "ms_per_token": median([s[0] for s in runs]) * 1e3,
            "ttft_ms": median([s[1] for s in runs]) * 1e3,
            "raw": [[s[0] * 1e3, s[1] * 1e3] for s in runs],
        }
        for name, runs in samples.items()
    }
    for name, r in rows.items():
        print(f"{name}: decode {r['ms_per_token']:.1f} ms/token, cached TTFT {r['ttft_ms']:.0f} ms", flush=True)
    out: dict = {"context_tokens": context, "decode_tokens": 32, "reps": reps, "arms": rows}
    for name in rows:
        if name != "auto":
            out[f"decode_speed_ratio_{name}_vs_auto"] = rows["auto"]["ms_per_token"] / rows[name]["ms_per_token"]
            out[f"ttft_ratio_{name}_vs_auto"] = rows[name]["ttft_ms"] / rows["auto"]["ttft_ms"]
            out[f"same_tokens_{name}"] = tokens.get(name) == tokens.get("auto")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--part", choices=["quality", "speed", "all"], default="all")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--agreement-repeats", type=int, default=4, help="top-1 agreement over the text this many times")
    ap.add_argument("--arms", default="int8,fp8", help="KV formats measured against auto (comma-separated)")
    ap.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB per engine")
    ap.add_argument("--note", default="", help="recorded as is (e.g. 'machine shared with other jobs')")
    ap.add_argument("--out", default=str(RESULTS / "kv_cache_dtype.json"))
    args = ap.parse_args()
    first = LLM(args.model, kv_cache_memory_gib=args.kv_cache_memory, max_model_len=args.context + 64)
    llms = {"auto": first}
    for name in args.arms.split(","):
        llms[name] = LLM(
            loaded=first.engine.loaded,
            kv_cache_memory_gib=args.kv_cache_memory,
            max_model_len=args.context + 64,
            kv_cache_dtype=name,
        )
    doc: dict = {
        "model": first.engine.loaded.name,
        "model_id": {n: llm.engine.model_id for n, llm in llms.items()},
        "compute_dtype": str(first.engine.runner.dtype),
        "kv_format": {n: llm.engine.runner.kv_format.description for n, llm in llms.items()},
        "kv_bytes_per_token": {n: llm.engine.kv_bytes_per_token for n, llm in llms.items()},
        "pool_tokens": {n: llm.engine.pool.num_blocks * llm.engine.block_size for n, llm in llms.items()},
        "kv_cache_memory_gib": args.kv_cache_memory,
        "torch_threads": torch.get_num_threads(),
        "note": args.note,
    }
    if args.part in ("quality", "all"):
        doc["quality"] = quality(llms, args.agreement_repeats)
    if args.part in ("speed", "all"):
        doc["speed"] = speed(llms, args.context, args.reps)
    out = Path(args.out)
    write_json(out, doc)
    plot(doc, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")


def plot(doc: dict, path: Path) -> None:
    """Tokens per budget, then (where measured) top-1 agreement with ``auto``, perplexity (axis
    zoomed to the values: the differences are a few percent) and decode ms/token, per arm."""
    plt = pyplot()
    q, s = doc.get("quality"), doc.get("speed")
    panels = ["tokens"] + (["agreement", "perplexity"] if q else []) + (["speed"] if s else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(3.7 * len(panels), 3.6), squeeze=False)
    names = list(doc["pool_tokens"])
    arms = [n for n in names if n != "auto"]
    color = {n: COLORS.get(n, "#555") for n in names}
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "tokens":
            ax.bar(names, [doc["pool_tokens"][n] for n in names], color=[color[n] for n in names])
            ax.set_title(f"tokens in {doc['kv_cache_memory_gib']} GiB", fontsize=9)
        elif panel == "agreement":
            values = [100 * q[f"top1_agreement_{n}"] for n in arms]
            ax.bar_label(ax.bar(arms, values, color=[color[n] for n in arms]), fmt="%.2f", fontsize=8)
            ax.set_ylim(min(values) - 2, 100)
            ax.set_title(f"top-1 agreement with auto, % ({q['agreement_positions']} positions)", fontsize=9)
        elif panel == "perplexity":
            values = [q[f"perplexity_{n}"] for n in names]
            ax.bar_label(ax.bar(names, values, color=[color[n] for n in names]), fmt="%.3f", fontsize=8)
            ax.set_ylim(min(values) * 0.97, max(values) * 1.02)
            ax.set_title(f"perplexity over the text ({q['text_tokens']} tokens)", fontsize=9)
        else:
            ax.bar(names, [s["arms"][n]["ms_per_token"] for n in names], color=[color[n] for n in names])
            ax.set_title(f"decode ms/token after {s['context_tokens']} cached", fontsize=9)
    fig.suptitle(
        f"{doc['model']}: KV {doc['compute_dtype']} vs {', '.join(arms)} rows {doc['note']}".strip(), fontsize=9
    )
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
