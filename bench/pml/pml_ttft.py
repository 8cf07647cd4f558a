"""TTFT of a PML prompt assembled from precomputed modules vs full prefill vs the prefix cache.

One schema holds 16 documents of ~500 tokens (each a module); a prompt selects the first
2 / 8 / 16 of them (~1k / 4k / 8k tokens, refs written in a shuffled order) plus a 32-token
question. For each size, median of 5 runs (PML: 5 x ``--pml-per-run`` samples, it is cheap) of:

- ``pml``: ``generate(<prompt ...>, max_tokens=1)`` wall time (parse, compile, module lookup,
  the question's prefill attending to the modules in place, first token);
- ``full``: the *same token ids* as a plain prompt, prefix cache emptied before each run;
- ``prefix``: a plain prompt of the same documents in a different order each run (run r
  starts with document r mod k; the cache is warm from earlier orders, but a prefix only
  helps up to the first differing document; with 2 documents, whose 2 orders come back,
  each run uses its own ``cache_salt`` under which the other order was sent first, so every
  run finds the system prompt and another order cached and its own order new).

    .venv/bin/python bench/pml/pml_ttft.py --model default          # fp32, CPU
    -> bench/results/pml_ttft.json, bench/results/pml_ttft.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from kvreuse import LLM, SamplingParams
from kvreuse.pml import compile_prompt, parse_prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json

NUM_DOCS, DOC_TOKENS, QUESTION_TOKENS = 16, 500, 32
SIZES = (2, 8, 16)  # documents selected: ~1k, 4k, 8k tokens
WORDS = [
    "amber",
    "basalt",
    "cedar",
    "delta",
    "ember",
    "fjord",
    "glacier",
    "harbor",
    "island",
    "juniper",
    "kestrel",
    "lagoon",
    "meadow",
    "nectar",
    "orchard",
    "prairie",
    "quartz",
    "river",
    "summit",
    "tundra",
    "upland",
    "valley",
    "willow",
    "yarrow",
    "zephyr",
]


def doc_text(tokenizer, i: int, n_tokens: int) -> str:
    rng = random.Random(i)
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words))) < n_tokens:
        words += [f"{rng.choice(WORDS)}{rng.randrange(100)}" for _ in range(40)]
    while len(tokenizer.encode(" ".join(words))) > n_tokens:
        words.pop()
    return f"Document {i}: " + " ".join(words)


def timed(llm: LLM, prompt, cache_salt: str | None = None) -> float:
    start = time.perf_counter()
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), cache_salt=cache_salt)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--pml-per-run", type=int, default=3, help="PML samples per run (cheap; steadies the median on a noisy machine)"
    )
    ap.add_argument("--kv-cache-memory", type=float, default=4.0)
    args = ap.parse_args()
    llm = LLM(
        args.model,
        dtype="float32",
        quantization="none",
        kv_cache_memory_gib=args.kv_cache_memory,
        max_model_len=NUM_DOCS * DOC_TOKENS + 512,
        max_num_batched_tokens=16384,
    )
    tok = llm.tokenizer
    docs = [doc_text(tok, i, DOC_TOKENS - 8) for i in range(NUM_DOCS)]
    schema = (
        '<schema name="ttft"><system>Answer from the documents.</system>'
        + "".join(f'<module name="d{i}">{d}</module>' for i, d in enumerate(docs))
        + "</schema>"
    )
    start = time.perf_counter()
    info = llm.register_schema(schema)
    precompute_s = time.perf_counter() - start
    compiled = llm.engine.modules.schemas["ttft"]
    question = doc_text(tok, 999, QUESTION_TOKENS - 4) + "?"
    rng = random.Random(0)
    rows = []
    for k in SIZES:
        refs = list(range(k))
        rng.shuffle(refs)
        pml = '<prompt schema="ttft">' + "".join(f"<d{i}/>" for i in refs) + f"{question}</prompt>"
        prepared = llm.engine.modules.prepare(pml)
        llm.engine.pool.release(reversed(prepared.context.blocks))
        compiled_prompt = compile_prompt(parse_prompt(pml), compiled, tok)
        ids_by_pos = {p: t for _, ts, ps in compiled.assembled(compiled_prompt) for t, p in zip(ts, ps)}
        ids_by_pos.update(zip(prepared.position_ids, prepared.token_ids))
        plain = [ids_by_pos[p] for p in sorted(ids_by_pos)]
        module_tokens = len(prepared.context.slots)
        timed(llm, pml)  # warm-up (allocator, first-call overheads)
        pml_s = [timed(llm, pml) for _ in range(args.runs * args.pml_per_run)]
        full_s = []
        for _ in range(args.runs):
            llm.reset_prefix_cache()  # module blocks are not in use: they go too, so re-register after
            full_s.append(timed(llm, plain))
        llm.register_schema(schema)
        # Prefix cache, documents in a different order each run (rotations: the first doc differs).
        system = plain[: len(compiled.module("").stored_token_ids)]
        doc_ids = [list(compiled.module(f"d{i}").stored_token_ids) for i in range(k)]
        q_ids = list(prepared.token_ids)
        prefix_s = []

        def rotation(r: int) -> list[int]:  # run r starts with document r % k
            order = doc_ids[r % k :] + doc_ids[: r % k]
            return system + [t for d in order for t in d] + q_ids

        for r in range(args.runs + 1):
            salt = None
            if k == 2 and r:
                # Only two orders exist: each run gets its own salt with the other order
                # cached under it first, so every run sees the same state (the system prompt
                # and another order cached; this order new), as with more documents.
                salt = f"orders-{r}"
                timed(llm, rotation(r - 1), cache_salt=salt)
            t = timed(llm, rotation(r), cache_salt=salt)
            if r:  # the first run only warms the cache
                prefix_s.append(t)
        row = {
            "documents": k,
            "module_tokens": module_tokens,
            "plain_prompt_tokens": len(plain),
            "pml_s": statistics.median(pml_s),
            "full_prefill_s": statistics.median(full_s),
            "prefix_cache_reordered_s": statistics.median(prefix_s),
            "runs": {"pml": pml_s, "full": full_s, "prefix": prefix_s},
        }
        row["speedup_vs_full"] = row["full_prefill_s"] / row["pml_s"]
        row["speedup_vs_prefix_cache"] = row["prefix_cache_reordered_s"] / row["pml_s"]
        rows.append(row)
        print(json.dumps({k2: v for k2, v in row.items() if k2 != "runs"}), flush=True)
    out = {
        "model": llm.engine.model_id,
        "dtype": "float32",
        "device": str(llm.engine.runner.device),
        "precompute_s": precompute_s,
        "schema_stored_tokens": info.stored_tokens,
        "runs": args.runs,
        "pml_samples_per_run": args.pml_per_run,
        "statistic": "median",
        "rows": rows,
    }
    write_json(RESULTS / "pml_ttft.json", out)
    plot(out, RESULTS / "pml_ttft.png")


def plot(out: dict, path: Path) -> None:
    plt = pyplot()

    rows = out["rows"]
    labels = [f"{r['module_tokens'] / 1000:.1f}k" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.27
    for j, (key, name) in enumerate(
        [
            ("full_prefill_s", "full prefill"),
            ("prefix_cache_reordered_s", "prefix cache, reordered docs"),
            ("pml_s", "PML modules"),
        ]
    ):
        vals = [r[key] for r in rows]
        bars = ax.bar([i + (j - 1) * w for i in x], vals, w, label=name)
        if key == "pml_s":
            for b, r in zip(bars, rows):
                ax.annotate(
                    f"{r['speedup_vs_full']:.0f}x",
                    (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
    ax.set_yscale("log")
    ax.set_xticks(list(x), labels)
    ax.set_xlabel("tokens assembled from modules (+ 32-token question)")
    ax.set_ylabel("TTFT, s (median of 5, log)")
    ax.set_title(f"PML TTFT, {out['model'].split('@')[0]}, fp32 {out['device']}")
    ax.legend()
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
