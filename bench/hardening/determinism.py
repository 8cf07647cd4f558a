"""Does a prefix-cache hit (or a batch) change a greedy answer? Issue 31, finding 3.

    PYTHONPATH=src .venv/bin/python bench/hardening/determinism.py [--prompts 5] [--tokens 1500] [--max-tokens 64]
        [--dtype auto] [--quantization auto] [--deterministic] [--speculative-tokens 0] [--tag NAME]
    -> bench/results/determinism[_NAME].json

In process (``kvreuse.LLM``), the default model unless ``--model``. Every prompt is a chat
prompt of about ``--tokens`` tokens (made-up paragraphs, a question at the end), temperature 0,
``--max-tokens`` tokens, ``ignore_eos``. For each prompt, alone: after ``reset_prefix_cache``
(a miss: the whole prompt computed in one chunk), again (a hit: only the tail past the last
full block computed), and again (a second hit). Then the prompts in batches of ``--batch``
after a reset (misses sharing their steps' matmuls) and again (hits, batched). Reported per
variant: how many prompts gave tokens other than the alone miss, and where they diverge.
Also recorded: the CPU (lscpu model and flags), torch's version and the engine settings.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from kvreuse import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, machine, write_json

PLACES = [
    "Alder",
    "Brennock",
    "Calloway",
    "Dunmere",
    "Eskdale",
    "Farrow",
    "Glenmark",
    "Harlow",
    "Ivel",
    "Jessop",
    "Kestrel",
    "Lorne",
    "Marrow",
    "Northby",
    "Orwell",
    "Penrith",
    "Quarry",
    "Rendle",
    "Stowe",
    "Tamsin",
]
KINDS = ["river", "town", "valley", "lake", "forest", "harbour", "bridge", "market"]


def cpu_info() -> dict:
    """The machine block's CPU model, the flags that pick kernels here, torch's version and threads."""
    m = machine()
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile", "amx_int8")
    return {
        "model": m["cpu_model"],
        "cpus": m["cpus"],
        "flags_of_interest": [f for f in wanted if f in m["cpu_flags"]],
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def paragraph(rng: random.Random) -> str:
    place, kind = rng.choice(PLACES), rng.choice(KINDS)
    a, b, c = rng.sample(PLACES, 3)
    return (
        f"The {kind} of {place} lies {rng.randrange(3, 90)} miles north of {a}. "
        f"It was first mapped in {rng.randrange(1600, 1900)} by a surveyor from {b}, who counted "
        f"{rng.randrange(20, 900)} houses along its edge. "
        f"Today about {rng.randrange(2, 60)} thousand people visit it each year, most of them in spring, "
        f"and the road from {c} is the easiest way in."
    )


def make_prompts(llm: LLM, n: int, tokens: int, seed: int) -> list[list[int]]:
    """``n`` chat prompts (token ids) of at least ``tokens`` tokens each, paragraphs added until long enough."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        paras: list[str] = []
        while True:
            paras.append(paragraph(rng))
            question = "Which place was mapped earliest, and by whom? Answer in detail."
            ids = llm.chat_token_ids([{"role": "user", "content": "\n\n".join(paras) + "\n\n" + question}])
            if len(ids) >= tokens:
                out.append(ids)
                break
    return out


def first_diff(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run(args: argparse.Namespace) -> dict:
    config = dict(dtype=args.dtype, quantization=args.quantization, speculative_tokens=args.speculative_tokens)
    if args.deterministic:
        config["deterministic"] = True
    t0 = time.perf_counter()
    llm = LLM(args.model, **config)
    load_s = time.perf_counter() - t0
    prompts = make_prompts(llm, args.prompts, args.tokens, args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def gen(batch: list[list[int]]) -> list[tuple[list[int], int]]:
        return [(list(o.token_ids), o.num_cached_tokens) for o in llm.generate(batch, params)]

    variants: dict[str, list[list[int]]] = {"miss": [], "hit": [], "hit_again": []}
    cached: dict[str, list[int]] = {k: [] for k in variants}
    t0 = time.perf_counter()
    for p in prompts:
        llm.reset_prefix_cache()
        for name in ("miss", "hit", "hit_again"):
            ((toks, nc),) = gen([p])
            variants[name].append(toks)
            cached[name].append(nc)
    for name in ("batch_miss", "batch_hit"):
        variants[name], cached[name] = [], []
    for i in range(0, len(prompts), args.batch):
        group = prompts[i : i + args.batch]
        llm.reset_prefix_cache()
        for name in ("batch_miss", "batch_hit"):
            for toks, nc in gen(group):
                variants[name].append(toks)
                cached[name].append(nc)
    run_s = time.perf_counter() - t0
    ref = variants["miss"]
    report = {}
    for name, outs in variants.items():
        diffs = [first_diff(r, o) for r, o in zip(ref, outs)]
        report[name] = {
            "differing": sum(d is not None for d in diffs),
            "first_diff_token": diffs,
            "cached_tokens": cached[name],
        }
    return {
        "cpu": cpu_info(),
        "model": args.model,
        "config": config,
        "settings": {
            "prompts": args.prompts,
            "prompt_tokens": [len(p) for p in prompts],
            "max_tokens": args.max_tokens,
            "batch": args.batch,
            "seed": args.seed,
        },
        "engine": {"dtype": str(llm.engine.runner.dtype) if hasattr(llm.engine, "runner") else None},
        "load_s": round(load_s, 1),
        "run_s": round(run_s, 1),
        "variants_vs_miss": report,
        "tokens": {k: v for k, v in variants.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--speculative-tokens", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    out = run(args)
    path = write_json(RESULTS / f"determinism{'_' + args.tag if args.tag else ''}.json", out, indent=1)
    summary = {k: v["differing"] for k, v in out["variants_vs_miss"].items()}
    print(
        json.dumps(
            {
                "cpu": out["cpu"]["model"],
                "flags": out["cpu"]["flags_of_interest"],
                "config": out["config"],
                "prompt_tokens": out["settings"]["prompt_tokens"],
                "differing_vs_miss": summary,
                "run_s": out["run_s"],
            },
            indent=1,
        )
    )
    print(f"-> {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
