"""Answer quality with PML modular reuse vs full prefill of the same tokens.

kvreuse invents 100 one-sentence documents (a person and one fact of one of five kinds:
city, pet, instrument, wall colour, food) and asks one question per document; the other
documents of a prompt are of other kinds. The schema follows Prompt Cache's union pattern for retrieved
documents: ``--slots`` unions, each holding every document as a member, so a document can
be placed in any slot and documents of one prompt sit at compact, adjacent positions. Each
prompt puts the asked document plus 2-4 others, in random order, into the first slots and
ends with a question and the answer's lead-in (``Question: Where does X live?\nAnswer: X
lives in``), a format SmolLM2-135M answers reliably with full prefill.

- ``modular``: the PML prompt (each document's KV computed alone at its slot positions);
- ``full``: the same token ids as a plain prompt (positions 0..n-1, everything attends to
  everything before it) -- what a server without Prompt Cache computes.

Greedy, 4 tokens. Reported: exact agreement of the generated tokens, agreement of the
answer (the first word generated, lower case), and accuracy (the fact's value appears in
the answer) of each mode.

    .venv/bin/python bench/quality/pml_quality.py --model default
    -> bench/results/pml_quality.json, bench/results/pml_quality.png
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from kvreuse import LLM, SamplingParams
from kvreuse.pml import compile_prompt, parse_prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, pyplot, save_png, write_json

FIRST = [
    "Anna",
    "Boris",
    "Clara",
    "David",
    "Elena",
    "Felix",
    "Greta",
    "Hugo",
    "Ines",
    "Jonas",
    "Karla",
    "Leon",
    "Mira",
    "Nils",
    "Olga",
    "Paul",
    "Rosa",
    "Sven",
    "Tara",
    "Victor",
]
LAST = ["Berg", "Costa", "Dahl", "Ford", "Hale"]
# kind -> (document, question, answer lead-in, values): every document states one fact of one kind
KINDS = {
    "city": (
        "{p} lives in {a}.",
        "Where does {p} live?",
        "{p} lives in",
        ["Oslo", "Lima", "Cairo", "Quito", "Dakar", "Riga", "Perth", "Hanoi", "Tunis", "Bern"],
    ),
    "pet": (
        "{p} keeps a pet {a}.",
        "What pet does {p} keep?",
        "{p} keeps a pet",
        ["otter", "falcon", "badger", "heron", "lynx", "beaver", "raven", "ferret"],
    ),
    "instrument": (
        "{p} plays the {a}.",
        "What does {p} play?",
        "{p} plays the",
        ["violin", "trumpet", "cello", "flute", "harp", "drums", "piano", "guitar"],
    ),
    "color": (
        "{p} paints every wall {a}.",
        "What color does {p} paint walls?",
        "{p} paints every wall",
        ["red", "blue", "green", "yellow", "purple", "orange", "white", "black"],
    ),
    "food": (
        "{p} eats only {a}.",
        "What does {p} eat?",
        "{p} eats only",
        ["rice", "bread", "apples", "cheese", "soup", "noodles", "beans", "fish"],
    ),
}


def make_dataset(num_docs: int, slots: int, seed: int) -> tuple[str, list[dict]]:
    """One fact per document; a prompt's other documents are of other kinds, so the question
    has one answer among the documents it selects."""
    rng = random.Random(seed)
    people = [f"{f} {last}" for last in LAST for f in FIRST][:num_docs]
    rng.shuffle(people)
    kinds = list(KINDS)
    facts = []
    for i, person in enumerate(people):
        kind = kinds[i % len(kinds)]
        facts.append({"person": person, "kind": kind, "value": rng.choice(KINDS[kind][3])})
    docs = [KINDS[f["kind"]][0].format(p=f["person"], a=f["value"]) + "\n" for f in facts]
    unions = "".join(
        "<union>" + "".join(f'<module name="s{k}d{i:03d}">{d}</module>' for i, d in enumerate(docs)) + "</union>"
        for k in range(slots)
    )
    schema = '<schema name="facts">Documents:\n' + unions + "</schema>"
    items = []
    for i, f in enumerate(facts):
        others = [j for j in range(num_docs) if facts[j]["kind"] != f["kind"]]
        picked: list[int] = []
        for j in rng.sample(others, len(others)):  # at most one distractor per other kind
            if all(facts[q]["kind"] != facts[j]["kind"] for q in picked):
                picked.append(j)
        refs = picked[: rng.randint(2, min(slots, len(kinds)) - 1)] + [i]
        rng.shuffle(refs)
        _, question, lead, _ = KINDS[f["kind"]]
        who = f["person"]
        prompt = (
            '<prompt schema="facts">'
            + "".join(f"<s{k}d{j:03d}/>" for k, j in enumerate(refs))
            + f"Question: {question.format(p=who)}\nAnswer: {lead.format(p=who)}</prompt>"
        )
        items.append({"doc": i, "refs": refs, "prompt": prompt, "answer": f["value"]})
    return schema, items


def plain_token_ids(llm: LLM, pml: str, schemas=None) -> list[int]:
    """The token ids a PML prompt stands for, in position order: what full prefill computes
    (``schemas``: compiled schemas by name; default the registered ones)."""
    schema = llm.engine.modules.schemas if schemas is None else schemas
    prompt = compile_prompt(parse_prompt(pml), schema, llm.tokenizer)
    compiled = schema[prompt.schema_name]
    by_pos = {p: t for _, ts, ps in compiled.assembled(prompt) for t, p in zip(ts, ps)}
    by_pos.update(zip(prompt.new_position_ids, prompt.new_token_ids))
    return [by_pos[p] for p in sorted(by_pos)]


def normalise(text: str) -> str:
    """The answer: the first word after the lead-in (the question ends mid-sentence)."""
    words = re.findall(r"[a-z]+", text.lower())
    return words[0] if words else ""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", type=int, default=5, help="unions of documents = most documents per prompt")
    ap.add_argument("--max-tokens", type=int, default=4)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="float32", quantization="none", kv_cache_memory_gib=2.0)
    schema, items = make_dataset(args.docs, args.slots, args.seed)
    info = llm.register_schema(schema, use_tqdm=True)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    modular = llm.generate([it["prompt"] for it in items], params)
    plain_ids = [plain_token_ids(llm, it["prompt"]) for it in items]
    full = llm.generate(plain_ids, params)
    rows = []
    for it, m, f, ids in zip(items, modular, full, plain_ids):
        rows.append(
            {
                "doc": it["doc"],
                "refs": it["refs"],
                "answer": it["answer"],
                "prompt_tokens": len(ids),
                "cached_tokens": m.num_cached_tokens,
                "modular": m.text,
                "full": f.text,
                "tokens_agree": m.token_ids == f.token_ids,
                "answer_agree": normalise(m.text) == normalise(f.text),
                "modular_correct": it["answer"].lower() in m.text.lower(),
                "full_correct": it["answer"].lower() in f.text.lower(),
            }
        )
    n = len(rows)
    summary = {
        "model": llm.engine.model_id,
        "dtype": "float32",
        "documents": args.docs,
        "questions": n,
        "schema_length": info.length,
        "slots": args.slots,
        "greedy_max_tokens": args.max_tokens,
        "token_agreement": sum(r["tokens_agree"] for r in rows) / n,
        "answer_agreement": sum(r["answer_agree"] for r in rows) / n,
        "accuracy_modular": sum(r["modular_correct"] for r in rows) / n,
        "accuracy_full": sum(r["full_correct"] for r in rows) / n,
        "mean_cached_fraction": sum(r["cached_tokens"] / r["prompt_tokens"] for r in rows) / n,
    }
    summary["accuracy_difference_points"] = 100 * (summary["accuracy_modular"] - summary["accuracy_full"])
    summary["passes"] = summary["answer_agreement"] >= 0.9 and abs(summary["accuracy_difference_points"]) <= 3
    print(json.dumps(summary, indent=2))
    write_json(RESULTS / "pml_quality.json", {"summary": summary, "rows": rows})
    plot(summary, RESULTS / "pml_quality.png")


def plot(s: dict, path: Path) -> None:
    plt = pyplot()

    labels = ["token agreement", "answer agreement", "accuracy (full)", "accuracy (modular)"]
    vals = [
        100 * s["token_agreement"],
        100 * s["answer_agreement"],
        100 * s["accuracy_full"],
        100 * s["accuracy_modular"],
    ]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(labels, vals, color=["#4c72b0", "#4c72b0", "#55a868", "#c44e52"])
    for b, v in zip(bars, vals):
        ax.annotate(f"{v:.0f}%", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom")
    ax.axhline(90, ls="--", c="gray", lw=1)
    ax.set_ylim(0, 105)
    ax.set_ylabel("% of questions")
    ax.set_title(f"PML modular reuse vs full prefill, {s['questions']} questions, {s['model'].split('@')[0]}")
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
