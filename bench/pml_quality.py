"""Answer quality with PML modular reuse vs full prefill of the same tokens.

kvreuse invents 100 short documents (a town, its mayor, its export; names made of random
syllables so the model cannot know them) and one question per document. A schema holds a
system turn and a user turn with every document as a module; each prompt selects the asked
document plus 2-4 others, refs written in random order, and asks ``Who is the mayor of X?``.

- ``modular``: the PML prompt (documents at their schema positions, each encoded alone);
- ``full``: the same token ids as a plain prompt (positions 0..n-1, everything attends to
  everything before it) -- what a server without Prompt Cache computes.

Greedy, 12 tokens. Reported: exact agreement of the generated tokens, agreement of the
normalised answer (first line, lower case, punctuation stripped), and accuracy (the mayor's
surname appears in the answer) of each mode.

    .venv/bin/python bench/pml_quality.py --model default
    -> bench/results/pml_quality.json, bench/results/pml_quality.png
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

from kvreuse import LLM, SamplingParams
from kvreuse.pml import compile_prompt, parse_prompt

RESULTS = Path(__file__).parent / "results"
SYLLABLES = "ka lo mi ren tas vor bel dun fi gar hol jin kes mar nos pel quin rus sol tem ul vek yor zan".split()
GOODS = ["copper bells", "blue wool", "salted fish", "glass beads", "pine resin", "clay pots", "goat cheese",
         "river pearls", "linen sails", "amber combs"]
FEATURES = ["northern coast", "eastern plain", "western hills", "southern marsh", "high plateau"]


def name(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(n)).capitalize()


def make_dataset(num_docs: int, seed: int) -> tuple[str, list[dict]]:
    rng = random.Random(seed)
    facts, towns = [], set()
    while len(facts) < num_docs:
        town = name(rng, 3)
        if town in towns:
            continue
        towns.add(town)
        facts.append({"town": town, "first": name(rng, 2), "last": name(rng, 3), "good": rng.choice(GOODS),
                      "feature": rng.choice(FEATURES)})
    modules = "".join(
        f'<module name="doc{i:03d}">{f["town"]} is a town on the {f["feature"]}. Its mayor is {f["first"]} '
        f'{f["last"]}, and its main export is {f["good"]}.\n</module>' for i, f in enumerate(facts))
    schema = ('<schema name="facts"><system>You answer questions about towns using only the documents. '
              'Answer with the name only.</system><user>Documents:\n' + modules + "</user></schema>")
    items = []
    for i, f in enumerate(facts):
        others = rng.sample([j for j in range(num_docs) if j != i], rng.randint(2, 4))
        refs = others + [i]
        rng.shuffle(refs)
        prompt = ('<prompt schema="facts">' + "".join(f"<doc{j:03d}/>" for j in refs)
                  + f'<user>Who is the mayor of {f["town"]}?</user></prompt>')
        items.append({"doc": i, "refs": refs, "prompt": prompt, "answer": f'{f["first"]} {f["last"]}',
                      "surname": f["last"]})
    return schema, items


def plain_token_ids(llm: LLM, pml: str) -> list[int]:
    """The token ids a PML prompt stands for, in position order: what full prefill computes."""
    schema = llm.engine.modules.schemas
    prompt = compile_prompt(parse_prompt(pml), schema, llm.tokenizer)
    compiled = schema[prompt.schema_name]
    by_pos = {p: t for _, ts, ps in compiled.assembled(prompt) for t, p in zip(ts, ps)}
    by_pos.update(zip(prompt.new_position_ids, prompt.new_token_ids))
    return [by_pos[p] for p in sorted(by_pos)]


def normalise(text: str) -> str:
    first = text.strip().split("\n")[0].lower()
    return re.sub(r"[^a-z ]", "", first).strip()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=12)
    args = ap.parse_args()
    llm = LLM(args.model, kv_cache_memory_gib=2.0)
    schema, items = make_dataset(args.docs, args.seed)
    info = llm.register_schema(schema)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    modular = llm.generate([it["prompt"] for it in items], params)
    plain_ids = [plain_token_ids(llm, it["prompt"]) for it in items]
    full = llm.generate(plain_ids, params)
    rows = []
    for it, m, f, ids in zip(items, modular, full, plain_ids):
        rows.append({
            "doc": it["doc"], "refs": it["refs"], "answer": it["answer"], "prompt_tokens": len(ids),
            "cached_tokens": m.num_cached_tokens, "modular": m.text, "full": f.text,
            "tokens_agree": m.token_ids == f.token_ids, "answer_agree": normalise(m.text) == normalise(f.text),
            "modular_correct": it["surname"].lower() in m.text.lower(),
            "full_correct": it["surname"].lower() in f.text.lower(),
        })
    n = len(rows)
    summary = {
        "model": llm.engine.model_id, "dtype": "float32", "documents": args.docs, "questions": n,
        "schema_length": info.length, "greedy_max_tokens": args.max_tokens,
        "token_agreement": sum(r["tokens_agree"] for r in rows) / n,
        "answer_agreement": sum(r["answer_agree"] for r in rows) / n,
        "accuracy_modular": sum(r["modular_correct"] for r in rows) / n,
        "accuracy_full": sum(r["full_correct"] for r in rows) / n,
        "mean_cached_fraction": sum(r["cached_tokens"] / r["prompt_tokens"] for r in rows) / n,
    }
    summary["accuracy_difference_points"] = 100 * (summary["accuracy_modular"] - summary["accuracy_full"])
    summary["passes"] = summary["answer_agreement"] >= 0.9 and abs(summary["accuracy_difference_points"]) <= 3
    print(json.dumps(summary, indent=2))
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pml_quality.json").write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    plot(summary, RESULTS / "pml_quality.png")


def plot(s: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["token agreement", "answer agreement", "accuracy (full)", "accuracy (modular)"]
    vals = [100 * s["token_agreement"], 100 * s["answer_agreement"], 100 * s["accuracy_full"],
            100 * s["accuracy_modular"]]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(labels, vals, color=["#4c72b0", "#4c72b0", "#55a868", "#c44e52"])
    for b, v in zip(bars, vals):
        ax.annotate(f"{v:.0f}%", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    ax.axhline(90, ls="--", c="gray", lw=1)
    ax.set_ylim(0, 105)
    ax.set_ylabel("% of questions")
    ax.set_title(f"PML modular reuse vs full prefill, {s['questions']} questions, {s['model'].split('@')[0]}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
