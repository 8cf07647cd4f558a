"""Issue 12's before/after decode measurements, in one process, interleaved, median of reps.

    PYTHONPATH=src .venv/bin/python bench/decode/decode12_ab.py settings [--tokens 16] [--reps 3] [--threads 1]
    PYTHONPATH=src .venv/bin/python bench/decode/decode12_ab.py attention [--tokens 48] [--reps 5] [--threads 1]
    PYTHONPATH=src .venv/bin/python bench/decode/decode12_ab.py flash-bf16 [--tokens 48] [--reps 5] [--threads 1]

Batch 1, greedy, ``ignore_eos``, a 16-token prompt, CPU. Prints per variant: decode tok/s,
wall ms per decode step ((wall - TTFT) / steps) and CPU ms per token (process time, which
the machine's load inflates less than wall time), and whether the tokens equal the first
variant's.

- ``settings``: one engine per setting: ``float32:none`` (the exact fp32 reference), ``bfloat16:int4``
  (what ``--dtype auto --quantization int4`` now picks on any CPU), ``float32:int4`` (what it
  picked on a CPU without native bf16 before).
- ``attention``: one ``auto:int4`` engine; ``before`` routes a decode that merges nothing
  through ``flash.flash`` and drops its log-sum-exp (the code before), ``after`` takes
  ``flash.attend_alone`` (softmax, no log-sum-exp).
- ``flash-bf16``: one ``auto:auto`` engine; ``matmuls`` runs a decode that merges nothing as
  fp32-score matmuls (``flash.math_attention``, as before), ``flash`` through PyTorch's CPU flash
  kernel in bf16 (``flash.attend_alone`` now). Both patch ``attention.attend_alone``, the name
  the decode path looks up.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from kvreuse import LLM, SamplingParams
from kvreuse.engine import attention, flash
from kvreuse.models.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import interleave, median

PROMPT = list(range(200, 216))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["settings", "attention", "flash-bf16"])
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.tokens is not None and args.tokens < 2:
        ap.error("--tokens must be at least 2 (decode speed is measured after the first token)")
    torch.set_num_threads(args.threads)
    if args.what == "settings":
        tokens, reps = args.tokens or 16, args.reps or 3
        llms = {
            s: LLM(
                loaded=load_model("default", dtype=s.split(":")[0], device="cpu", quantization=s.split(":")[1]),
                kv_cache_memory_gib=0.1,
            )
            for s in ("float32:none", "bfloat16:int4", "float32:int4")
        }
        variants = {s: (llm, lambda: None) for s, llm in llms.items()}
    elif args.what == "attention":
        tokens, reps = args.tokens or 48, args.reps or 5
        llm = LLM(
            loaded=load_model("default", dtype="auto", device="cpu", quantization="int4"), kv_cache_memory_gib=0.1
        )
        new = attention.attend_alone
        old = lambda q, k, v, scale: flash.flash(q, k, v, scale)[0]  # noqa: E731 (the code before)
        variants = {
            "before": (llm, lambda: setattr(attention, "attend_alone", old)),
            "after": (llm, lambda: setattr(attention, "attend_alone", new)),
        }
    if args.what == "flash-bf16":
        tokens, reps = args.tokens or 48, args.reps or 5
        llm = LLM(
            loaded=load_model("default", dtype="auto", device="cpu", quantization="auto"), kv_cache_memory_gib=0.1
        )
        new = attention.attend_alone
        matmuls = lambda q, k, v, scale: flash.math_attention(q, k, v, scale, False)[0]  # noqa: E731
        variants = {
            "matmuls": (llm, lambda: setattr(attention, "attend_alone", matmuls)),
            "flash": (llm, lambda: setattr(attention, "attend_alone", new)),
        }
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    names = list(variants)
    for llm, use in variants.values():  # warm-up
        use()
        llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    toks: dict[str, list[int]] = {}

    def arm(n: str):
        def run() -> tuple[float, float]:  # (wall ms per decode step, cpu ms per token)
            llm, use = variants[n]
            use()
            c, t = time.process_time(), time.perf_counter()
            out = llm.generate(PROMPT, params)[0]
            w, c = time.perf_counter() - t, time.process_time() - c
            toks[n] = out.token_ids
            return (w - out.ttft_s) / (len(out.token_ids) - 1) * 1e3, c / len(out.token_ids) * 1e3

        return run

    samples = interleave({n: arm(n) for n in names}, reps)  # the order rotates every repetition
    wall = {n: [w for w, _ in samples[n]] for n in names}
    cpu = {n: [c for _, c in samples[n]] for n in names}
    print(f"{args.what}: threads={torch.get_num_threads()} tokens={tokens} reps={reps}")
    for n in names:
        print(
            f"{n:>14}: {1e3 / median(wall[n]):6.1f} tok/s  wall {median(wall[n]):7.2f} ms/step"
            f"  cpu {median(cpu[n]):7.2f} ms/token  same tokens as {names[0]}: {toks[n] == toks[names[0]]}"
        )


if __name__ == "__main__":
    main()
