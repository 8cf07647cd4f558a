"""Schema-free documents over HTTP: TTFT of a chat whose documents are reused (shuffled per
request) vs full prefill of the same chat, through real ``kvreuse serve`` processes driven by
the official ``openai`` client.

A chat: a system turn, ``--docs`` user messages of ~``--doc-tokens`` tokens each marked
``"kvreuse": {"document": true}``, in a new random order every request, and a question of ~32
tokens (~4k tokens in all with the defaults). Every document is sent once first (its KV
computed once). Then, ``--reps`` times, interleaved, against each server:

- ``full``: the same messages unmarked under a fresh ``cache_salt`` (nothing cached: full prefill);
- ``documents``: marked, ``blend`` ``{"first_tokens": 0, "ratio": 0}`` (no seam repair);
- ``repair k/r[/layer/last]``: marked, with each seam repair of ``--repairs`` (``k:r[:layer[:j]],...``:
  first_tokens k, ratio r, deviation layer, last_tokens j; the default's choice is
  bench/quality/blend_quality.py's).

TTFT is the wall time of a ``max_tokens=1`` request (HTTP, template, tokenizing, the KV copy to
the request's positions, repair, the question's prefill, one token). ``cached_tokens`` is
checked: every context token (documents and the template text between them) is reused.

Servers: ``fp32`` (``--dtype float32 --quantization none``, the exact reference) and
``quick`` (the quick start's ``--dtype auto --quantization int4``), the default model each.

    PYTHONPATH=src .venv/bin/python bench/prefix/docs_ttft.py [--reps 5] [--servers fp32,quick]
    -> bench/results/docs_ttft.json, bench/results/docs_ttft.png
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, free_port, pyplot, running_servers, save_png, write_json
from bench.peer.peer_llamacpp import gemm_gflops
from bench.pml.pml_ttft import doc_text

SERVERS = {
    "fp32": ["--dtype", "float32", "--quantization", "none"],
    "quick": ["--dtype", "auto", "--quantization", "int4"],
}
QUESTION = (
    "Question: which of the documents above mentions a glacier next to a harbor, and what number "
    "follows the word river in that document? Answer briefly."
)


def messages(docs: list[str], order: list[int], marked: bool) -> list[dict]:
    mark = {"kvreuse": {"document": True}} if marked else {}
    return (
        [{"role": "system", "content": "Answer from the documents."}]
        + [{"role": "user", "content": docs[i], **mark} for i in order]
        + [{"role": "user", "content": QUESTION}]
    )


def timed(client, msgs: list[dict], **extra) -> tuple[float, dict]:
    start = time.perf_counter()
    out = client.chat.completions.create(
        model="m", messages=msgs, max_tokens=1, temperature=0, extra_body=extra or None
    )
    wall = time.perf_counter() - start
    details = out.usage.prompt_tokens_details
    return wall, {
        "prompt_tokens": out.usage.prompt_tokens,
        "cached_tokens": details.cached_tokens,
        "recomputed_tokens": (details.model_extra or {}).get("recomputed_tokens", 0),
    }


def check(u: dict, seen: dict[str, list[dict]]) -> None:
    """What the docstring promises: full prefill reuses nothing; a documents request reuses
    its whole context less what repair recomputed; every kind sends the same prompt."""
    prompts = {x["prompt_tokens"] for runs in seen.values() for x in runs} | {u["prompt_tokens"]}
    if len(prompts) != 1:
        raise SystemExit(f"docs_ttft: the kinds sent different prompts ({sorted(prompts)} tokens)")
    context = [x["cached_tokens"] for x in seen["documents"]]
    if u["recomputed_tokens"] == 0 and u["cached_tokens"] == 0:
        return  # full prefill (or the first request of a kind: checked against documents below)
    if context and u["cached_tokens"] + u["recomputed_tokens"] != context[0]:
        raise SystemExit(
            f"docs_ttft: cached {u['cached_tokens']} + recomputed {u['recomputed_tokens']} is not "
            f"the {context[0]} context tokens reused without repair"
        )


def repair_gflop(shape, linear_params: int, context: int, own: int, recomputed: int, deviation_layer: int) -> float:
    """FLOPs (GFLOP) of a documents request with seam repair, the least any implementation
    runs: the deviation pass (``deviation_layer`` 0: none, no ratio; else layers
    ``0 .. deviation_layer - 1`` over the ``context`` keys, every linear layer and causal
    attention among them, then only the compared layer's K and V projections), the
    ``recomputed`` tokens through every layer (each attending to ~half the context on
    average: the tokens are spread over it), the ``own`` tokens after the last document over
    the whole context, one lm_head row. Attention counts QK and PV (2 x 2 FLOPs per head dim)."""
    per_pair = 4 * shape.num_attention_heads * shape.head_dim  # FLOPs per (query, key) pair per layer
    per_token = 2 * linear_params / shape.num_layers  # linear FLOPs per token per layer
    kv_projection = 2 * shape.hidden_size * 2 * shape.num_kv_heads * shape.head_dim  # K and V of one token, one layer
    deviation = 0.0
    if deviation_layer:
        deviation = (
            deviation_layer * (context * per_token + per_pair * context * (context + 1) / 2) + context * kv_projection
        )
    repair = shape.num_layers * recomputed * (per_token + per_pair * context / 2)
    question = shape.num_layers * own * (per_token + per_pair * (context + (own + 1) / 2))
    return (deviation + repair + question + 2 * shape.hidden_size * shape.vocab_size) / 1e9


def full_gflop(shape, linear_params: int, n: int) -> float:
    """FLOPs (GFLOP) of a full prefill of ``n`` tokens: every linear layer per token, causal
    attention, one lm_head row."""
    per_pair = 4 * shape.num_attention_heads * shape.head_dim
    return (
        2 * linear_params * n + shape.num_layers * per_pair * n * (n + 1) / 2 + 2 * shape.hidden_size * shape.vocab_size
    ) / 1e9


def floors(model: str, result: dict, peak: float | None = None) -> dict:
    """The compute floor of each kind at the fp32 GEMM peak measured now (2 threads, as the
    servers ran; the servers are gone, so the machine is as idle as it gets): what no
    implementation beats on this machine in fp32."""
    import torch

    from kvreuse.models.loader import load_model

    torch.set_num_threads(2)
    loaded = load_model(model, dtype="float32", quantization="none")
    shape = loaded.shape
    linear_params = sum(
        m.weight.numel()
        for name, m in loaded.model.named_modules()
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")
    )
    if peak is None:
        peak = max(gemm_gflops(torch.float32, shape.hidden_size) for _ in range(3))
    fp32 = result["servers"].get("fp32")
    out = {"gemm_gflops_fp32": peak, "kinds": {}}
    if fp32 is None:
        return out
    n, context = fp32["prompt_tokens"], fp32["cached_tokens"]["documents"]
    for kind, med in fp32["ttft_median_s"].items():
        if kind == "full":
            gflop = full_gflop(shape, linear_params, n)
        else:
            spec = result["repairs"].get(kind, {"ratio": 0.0})
            layer = spec.get("deviation_layer", 1) if spec["ratio"] > 0 else 0
            gflop = repair_gflop(shape, linear_params, context, n - context, fp32["recomputed_tokens"][kind], layer)
        floor = gflop / peak
        out["kinds"][kind] = {
            "gflop": gflop,
            "floor_s": floor,
            "ttft_s": med,
            "ttft_over_floor": med / floor,
            "best_speedup_vs_full": fp32["ttft_median_s"]["full"] / floor,
        }
    return out


def repair_spec(item: str) -> dict:
    """``first:ratio[:deviation_layer[:last_tokens]]`` -> a request's ``blend`` object (every field
    explicit, so the server's own default never fills one in)."""
    parts = item.split(":")
    if not 2 <= len(parts) <= 4:
        raise SystemExit(f"--repairs: {item!r} is not first_tokens:ratio[:deviation_layer[:last_tokens]]")
    spec = {"first_tokens": int(parts[0]), "ratio": float(parts[1]), "last_tokens": 0}
    if len(parts) > 2:
        spec["deviation_layer"] = int(parts[2])
    if len(parts) > 3:
        spec["last_tokens"] = int(parts[3])
    return spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=500)
    ap.add_argument(
        "--repairs",
        default="1:0:1:1,1:0.1:1:1",
        help="seam repairs to time, first_tokens:ratio[:deviation_layer[:last_tokens]],...",
    )
    ap.add_argument("--servers", default="fp32,quick")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import openai

    from kvreuse.models.loader import load_model

    names = args.servers.split(",")
    tokenizer = load_model(args.model, dtype="float32").tokenizer
    docs = [doc_text(tokenizer, i, args.doc_tokens) for i in range(args.docs)]
    off = {"first_tokens": 0, "ratio": 0.0, "last_tokens": 0}
    repairs = {f"repair {item.replace(':', '/')}": repair_spec(item) for item in args.repairs.split(",")}
    kinds = ("full", "documents", *repairs)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        specs = [
            (
                free_port(),
                [
                    "--model",
                    args.model,
                    "--served-model-name",
                    "m",
                    "--kv-cache-memory",
                    "1.5",
                    "--log-level",
                    "warning",
                    *SERVERS[n],
                ],
                Path(tmp) / f"{n}.log",
            )
            for n in names
        ]
        with running_servers(specs, startup_s=600) as urls:
            clients = {n: openai.OpenAI(base_url=u + "/v1", api_key="none", timeout=600) for n, u in zip(names, urls)}
            for client in clients.values():  # every document's KV computed once; warm the paths
                timed(client, messages(docs, list(range(args.docs)), True), blend=off)
                timed(client, messages(docs, list(range(args.docs)), False), cache_salt="warm")
            samples = {n: {k: [] for k in kinds} for n in names}
            usage = {n: {k: [] for k in kinds} for n in names}
            for rep in range(args.reps):
                order = rng.sample(range(args.docs), args.docs)
                runs = [(n, kind) for n in names for kind in kinds]
                rng.shuffle(runs)  # interleaved, in a new order each repetition
                for n, kind in runs:
                    if kind == "full":
                        wall, u = timed(
                            clients[n], messages(docs, order, False), cache_salt=f"cold-{rep}-{time.time()}"
                        )
                    else:
                        wall, u = timed(
                            clients[n], messages(docs, order, True), blend=off if kind == "documents" else repairs[kind]
                        )
                    check(u, usage[n])
                    samples[n][kind].append(wall)
                    usage[n][kind].append(u)
                    print(rep, n, kind, f"{wall:.3f}s", u, flush=True)
    result = {
        "model": args.model,
        "docs": args.docs,
        "doc_tokens": args.doc_tokens,
        "reps": args.reps,
        "repairs": repairs,
        "servers": {},
    }
    for n in names:
        med = {k: statistics.median(v) for k, v in samples[n].items()}
        result["servers"][n] = {
            "args": SERVERS[n],
            "ttft_median_s": med,
            "ttft_samples_s": samples[n],
            "usage": usage[n],
            "speedup_vs_full": {k: med["full"] / med[k] for k in kinds if k != "full"},
            "prompt_tokens": usage[n]["full"][0]["prompt_tokens"],
            "cached_tokens": {k: usage[n][k][0]["cached_tokens"] for k in kinds},
            "recomputed_tokens": {k: usage[n][k][0]["recomputed_tokens"] for k in kinds},
        }
        print(n, json.dumps({k: v for k, v in result["servers"][n].items() if k not in ("ttft_samples_s", "usage")}))
    result["fp32_floors"] = floors(args.model, result)
    print("fp32 floors", json.dumps(result["fp32_floors"], indent=1))
    write_json(RESULTS / "docs_ttft.json", result)
    plot(result, RESULTS / "docs_ttft.png")


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.2))
    kinds = ("full", "documents", *result["repairs"])
    labels = {
        "full": "full prefill",
        "documents": "documents,\nno repair",
        **{k: f"documents,\n{k}" for k in result["repairs"]},
    }
    width = 0.8 / len(result["servers"])
    for j, (name, s) in enumerate(result["servers"].items()):
        values = [s["ttft_median_s"][k] for k in kinds]
        bars = ax.bar([i + j * width for i in range(len(kinds))], values, width, label=name)
        for bar, k in zip(bars, kinds):
            text = f"{bar.get_height():.2f}s" + (
                "" if k == "full" else f"\n{s['ttft_median_s']['full'] / bar.get_height():.0f}x"
            )
            ax.annotate(
                text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7
            )
    floors = result.get("fp32_floors", {}).get("kinds", {})
    if floors and "fp32" in result["servers"]:  # the fp32 compute floor of each kind: a bar at it
        j = list(result["servers"]).index("fp32")
        xs = [i + j * width for i, k in enumerate(kinds) if k in floors]
        ax.scatter(
            xs,
            [floors[k]["floor_s"] for k in kinds if k in floors],
            marker="_",
            s=600,
            color="black",
            zorder=3,
            label="fp32 compute floor",
        )
    ax.set_xticks([i + width * (len(result["servers"]) - 1) / 2 for i in range(len(kinds))], [labels[k] for k in kinds])
    ax.set_yscale("log")
    ax.set_ylabel("TTFT, median (s, log)")
    first = next(iter(result["servers"].values()))
    ax.set_title(
        f"{result['docs']} shuffled documents x ~{result['doc_tokens']} tokens + question "
        f"({first['prompt_tokens']} tokens), HTTP",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
