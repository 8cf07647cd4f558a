"""Seam repair (selective recompute) vs answer quality and TTFT: the Pareto curve.

Two question sets, each through PML modules (``--mode pml``) or schema-free documents
(``--mode documents``: the same token ids as a ``DocumentPrompt``, the head text, each selected
module's text as a document, the question; contiguous positions), and through full prefill of
the same token ids (contiguous positions):

- ``single``: bench/quality/pml_quality.py's set (100 one-fact documents, 5 union slots, each
  question needs one document);
- ``pair``: a new set whose questions need two documents at once: ``X's sister is Y.`` in
  one module and ``Y lives in <city>.`` in another, plus distractors (other people's
  sisters and cities), asked ``Where does X's sister live?``. A seam sits between the two
  facts, so an unrepaired prompt cannot link them inside the KV.

For each repair setting (``first_tokens`` x ``ratio``) every question runs greedy, 4 tokens,
batched; then ``--ttft-questions`` of them run one at a time (max_tokens=1) for TTFT.
Reported per set and setting: answer agreement with full prefill (first word), accuracy
(the fact's value in the answer), recomputed fraction of module tokens, median TTFT; for the
pair set also ``chose``: the share of answers naming the distractor's city and the share naming
whichever of the two visible cities comes last (a position preference, not linking). PML
places modules at the schema's (gapped) positions, so its ratio 1.0 is full prefill at those
positions, not the contiguous one: ``agreement_with_full_repair`` compares with it (the seam
effect alone). In documents mode the positions are contiguous and ratio 1.0 is full prefill.

    PYTHONPATH=src .venv/bin/python bench/quality/blend_quality.py --model default [--dtype float32]
    -> bench/results/blend_quality_<mode>_<dtype>.json, .png
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
from kvreuse.api.chat_prompt import special_lead
from kvreuse.engine.blend import Blend
from kvreuse.engine.document_cache import DocumentPrompt
from kvreuse.pml.prepared import prepare_prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json
from bench.quality.pml_quality import FIRST, LAST, make_dataset, normalise, plain_token_ids

PAIR_LAST = ["Ivers", "Kent", "Lund", "Marsh", "Noble"]  # with pml_quality's 5: 200 people, 100 pairs
CITIES = ["Oslo", "Lima", "Cairo", "Quito", "Dakar", "Riga", "Perth", "Hanoi", "Tunis", "Bern"]
# (first_tokens, ratio[, deviation_layer[, last_tokens]]); documents here are ~8 tokens, so first_tokens 4 is
# half of each
SETTINGS = [
    (0, 0.0),
    (0, 0.05),
    (0, 0.1),
    (0, 0.15),
    (0, 0.3),
    (0, 1.0),
    (1, 0.0),
    (1, 0.1),
    (2, 0.0),
    (2, 0.1),
    (4, 0.1),
]


def setting_key(setting: tuple) -> tuple[int, float, int, int]:
    """``(first_tokens, ratio, deviation_layer, last_tokens)`` of a SETTINGS entry, the order of
    Blend's fields (the missing ones take Blend's defaults)."""
    default = Blend()
    k, r, layer, last = (*setting, *(default.deviation_layer, default.last_tokens)[len(setting) - 2 :])
    return int(k), float(r), int(layer), int(last)


def make_pair_dataset(num_questions: int, slots: int, seed: int) -> tuple[str, list[dict]]:
    """Two kinds of one-sentence documents (``A's sister is B.``, ``B lives in C.``) as
    union members; each question selects its two documents plus distractors of both kinds
    about other people, in random slot order."""
    rng = random.Random(seed)
    people = [f"{f} {last}" for last in LAST + PAIR_LAST for f in FIRST]  # 2 per question
    if len(people) < 2 * num_questions:
        raise SystemExit(f"--questions {num_questions}: the pair set has names for at most {len(people) // 2}")
    people += [f"{f} {m}. {last}" for m in "ABCDEFGH" for last in LAST for f in FIRST][
        : max(0, 2 * num_questions - len(people))
    ]
    rng.shuffle(people)
    pairs = [(people[2 * i], people[2 * i + 1], rng.choice(CITIES)) for i in range(num_questions)]
    docs = []
    for a, b, city in pairs:
        docs.append(f"{a}'s sister is {b}.\n")
        docs.append(f"{b} lives in {city}.\n")
    unions = "".join(
        "<union>" + "".join(f'<module name="s{k}d{i:03d}">{d}</module>' for i, d in enumerate(docs)) + "</union>"
        for k in range(slots)
    )
    schema = '<schema name="pairs">Documents:\n' + unions + "</schema>"
    items = []
    for q, (a, _b, city) in enumerate(pairs):
        others = [j for j in range(len(pairs)) if j != q and pairs[j][2] != city]
        d1, d2 = rng.sample(others, 2)
        refs = [2 * q, 2 * q + 1, 2 * d1, 2 * d2 + 1][:slots]
        rng.shuffle(refs)
        prompt = (
            '<prompt schema="pairs">'
            + "".join(f"<s{k}d{j:03d}/>" for k, j in enumerate(refs))
            + f"Question: Where does {a}'s sister live?\nAnswer: {a}'s sister lives in</prompt>"
        )
        # the other visible city (the distractor "lives in" document's) and which comes last:
        # with two cities in view, accuracy alone cannot tell linking from a position preference
        last = city if refs.index(2 * q + 1) > refs.index(2 * d2 + 1) else pairs[d2][2]
        items.append(
            {"doc": q, "refs": refs, "prompt": prompt, "answer": city, "distractor": pairs[d2][2], "last_city": last}
        )
    return schema, items


def document_prompt(llm: LLM, pml: str, schemas, lead: list[int] = ()) -> DocumentPrompt:
    """The PML prompt's token ids as documents: the schema's head text, each selected module's
    stored tokens as a document, then the question (the prompt's new tokens). ``schemas``:
    compiled, not registered (documents mode never computes module KV)."""
    prepared = prepare_prompt(pml, schemas, llm.tokenizer)
    schema = prepared.plan.schema
    if prepared.plan.dropped is not None:
        raise SystemExit("documents mode: a prompt with no text after its last module is not supported")
    names = prepared.plan.modules
    parts = [(list(schema.module(n).stored_token_ids), n != "") for n in names]
    head = [(list(lead), False)] if lead else []
    return DocumentPrompt.of([*head, *parts, (list(prepared.token_ids), False)])


def run_set(llm: LLM, name: str, schema: str, items: list[dict], args) -> dict:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    first = SamplingParams(max_tokens=1, temperature=0)
    if args.mode == "documents":
        compiled = llm.engine.modules.compile(schema)
        schemas = {compiled.name: compiled}
        # PML adds no BOS; a documents prompt over the completions API gets the tokenizer's
        # (Gemma 3's) once at its start: --bos auto does the same to both sides here
        lead = special_lead(llm.tokenizer) if args.bos == "auto" else []
        plain = [lead + plain_token_ids(llm, it["prompt"], schemas) for it in items]
        prompts = [document_prompt(llm, it["prompt"], schemas, lead) for it in items]
        for p, ids in zip(prompts, plain):
            assert [t for part, _ in p.parts for t in part] == ids, "documents mode: token ids differ from PML's"
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))  # every document computed once
        module_tokens = [p.layout().num_document_tokens for p in prompts]
    else:
        llm.register_schema(schema)
        plain = [plain_token_ids(llm, it["prompt"]) for it in items]
        prompts = [it["prompt"] for it in items]
        module_tokens = [llm.engine.modules.source(llm.engine.prepare_prompt(p).plan).num_tokens for p in prompts]
    full = llm.generate(plain, params)
    timed = range(min(args.ttft_questions, len(items)))
    out = {"full": {"accuracy": _acc(items, full), "chose": _choices(items, full)}, "settings": []}
    print(name, "full prefill", json.dumps(out["full"]), flush=True)
    rows_ttft = {}
    # TTFT interleaved: for each timed question, full prefill then every setting, one at a time
    for i in timed:
        rows_ttft.setdefault("full", []).append(
            llm.generate(plain[i], first, cache_salt=f"cold-{i}-{time.time()}")[0].ttft_s
        )
        for setting in map(setting_key, SETTINGS):
            rows_ttft.setdefault(setting, []).append(llm.generate(prompts[i], first, blend=Blend(*setting))[0].ttft_s)
    out["full"]["ttft_median_s"] = statistics.median(rows_ttft["full"]) if timed else None
    answers = {}
    for setting in map(setting_key, SETTINGS):
        k, r, layer, last = setting
        blend = Blend(k, r, layer, last)
        t0 = time.perf_counter()
        mod = llm.generate(prompts, params, blend=blend)
        wall = time.perf_counter() - t0
        answers[setting] = mod
        agree = [normalise(m.text) == normalise(f.text) for m, f in zip(mod, full)]
        ttft = rows_ttft.get(setting, [])
        row = {
            "first_tokens": k,
            "ratio": r,
            "deviation_layer": layer,
            "last_tokens": last,
            "answer_agreement": sum(agree) / len(items),
            "token_agreement": sum(m.token_ids == f.token_ids for m, f in zip(mod, full)) / len(items),
            "accuracy": _acc(items, mod),
            "chose": _choices(items, mod),
            "recomputed_fraction": sum(m.num_recomputed_tokens for m in mod) / sum(module_tokens),
            "ttft_median_s": statistics.median(ttft) if ttft else None,
            "batch_wall_s": wall,
            "disagreements": [i for i, a in enumerate(agree) if not a],
        }
        print(name, json.dumps({k2: v for k2, v in row.items() if k2 != "disagreements"}), flush=True)
        out["settings"].append(row)
    everything = answers.get(setting_key((0, 1.0)))  # ratio 1.0: full prefill at the context's own positions
    for row in out["settings"] if everything is not None else ():
        mod = answers[(row["first_tokens"], row["ratio"], row["deviation_layer"], row["last_tokens"])]
        row["agreement_with_full_repair"] = sum(
            normalise(m.text) == normalise(e.text) for m, e in zip(mod, everything)
        ) / len(items)
    out["questions"] = len(items)
    out["mean_module_tokens"] = sum(module_tokens) / len(items)
    out["mean_prompt_tokens"] = sum(len(p) for p in plain) / len(items)
    return out


def _choices(items: list[dict], outs) -> dict | None:
    """For the pair set: the share of answers naming the distractor's city, and the share naming
    whichever of the two visible cities comes last in the prompt (None for other sets)."""
    if not items or "distractor" not in items[0]:
        return None
    said = [o.text.lower() for o in outs]
    return {
        "distractor": sum(it["distractor"].lower() in t for it, t in zip(items, said)) / len(items),
        "last_city": sum(it["last_city"].lower() in t for it, t in zip(items, said)) / len(items),
    }


def _acc(items: list[dict], outs) -> float:
    return sum(it["answer"].lower() in o.text.lower() for it, o in zip(items, outs)) / len(items)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--quantization",
        default="none",
        help="weights: none (the exact reference, as every figure in docs/benchmarks.md) | auto | int8 | int4",
    )
    ap.add_argument(
        "--mode",
        default="pml",
        choices=["pml", "documents"],
        help="pml: union-slot modules; documents: the same tokens as schema-free documents",
    )
    ap.add_argument("--questions", type=int, default=100, help="per set")
    ap.add_argument("--ttft-questions", type=int, default=10)
    ap.add_argument("--slots", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--settings",
        default=None,
        help="first_tokens:ratio[:deviation_layer[:last_tokens]],... instead of the default grid",
    )
    ap.add_argument("--sets", default="single,pair")
    ap.add_argument(
        "--bos",
        default="auto",
        choices=["auto", "off"],
        help="documents mode: put the tokenizer's BOS (if it adds one: Gemma 3) before the prompt",
    )
    ap.add_argument("--tag", default="", help="suffix of the result files")
    args = ap.parse_args()
    if args.settings:
        SETTINGS[:] = [setting_key(tuple(x.split(":"))) for x in args.settings.split(",")]
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization, kv_cache_memory_gib=2.0)
    result = {
        "model": llm.engine.model_id,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "mode": args.mode,
        "sets": {},
    }
    sets = {
        "single": lambda: make_dataset(args.questions, args.slots, args.seed),
        "pair": lambda: make_pair_dataset(args.questions, 4, args.seed),
    }
    for name in args.sets.split(","):
        schema, items = sets[name]()
        result["sets"][name] = run_set(llm, name, schema, items, args)
        llm.engine.check_integrity()
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = (
        f"blend_quality_{args.mode}_{args.dtype}" + ("" if args.questions == 100 else f"_{args.questions}q") + args.tag
    )
    write_json(RESULTS / f"{stem}.json", result)
    plot(result, RESULTS / f"{stem}.png")


def plot(result: dict, path: Path) -> None:
    """Answer agreement against the cost of the repair: the recomputed share of the document
    tokens (top) and the median TTFT of these short prompts (bottom), one column per set."""
    plt = pyplot()

    sets = result["sets"]
    fig, axes = plt.subplots(2, len(sets), figsize=(6 * len(sets), 8), squeeze=False)
    for col, (name, s) in enumerate(sets.items()):
        for row, (key, scale, label) in enumerate(
            (
                ("recomputed_fraction", 100, "recomputed share of document tokens (%)"),
                ("ttft_median_s", 1000, "median TTFT (ms)"),
            )
        ):
            ax = axes[row][col]

            def series_of(r):
                return r["first_tokens"], r.get("deviation_layer", 1), r.get("last_tokens", 0)

            for k, layer, last in sorted({series_of(r) for r in s["settings"]}):
                rows = sorted(
                    (r for r in s["settings"] if series_of(r) == (k, layer, last) and r[key] is not None),
                    key=lambda r: r["ratio"],
                )
                if not rows:
                    continue
                marker = {0: "o", 1: "s", 2: "^", 4: "D"}.get(k, "x")
                ax.plot(
                    [scale * r[key] for r in rows],
                    [100 * r["answer_agreement"] for r in rows],
                    marker=marker,
                    ls="-" if (layer, last) == (1, 0) else "--",
                    label=f"first_tokens={k}"
                    + ("" if layer == 1 else f", deviation at layer {layer}")
                    + ("" if not last else f", last_tokens={last}"),
                )
                for r in rows:
                    ax.annotate(
                        f"{r['ratio']:g}",
                        (scale * r[key], 100 * r["answer_agreement"]),
                        fontsize=7,
                        xytext=(3, 3),
                        textcoords="offset points",
                    )
            if key == "ttft_median_s" and s["full"]["ttft_median_s"] is not None:
                ax.axvline(1000 * s["full"]["ttft_median_s"], ls="--", c="gray", lw=1, label="full prefill TTFT")
            ax.set_xlabel(label)
            ax.set_ylabel("answer agreement with full prefill (%)")
            ax.set_title(f"{name} ({s['questions']} questions); point labels: ratio", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(f"seam repair ({result['mode']}): quality vs cost, {result['model'].split('@')[0]} {result['dtype']}")
    fig.tight_layout()
    save_png(fig, path, dpi=110)


if __name__ == "__main__":
    main()
