"""Two source trees side by side: batch-1 decode and cached-prefix TTFT of the default model,
in process, one fresh subprocess per sample, the two trees alternating (A B B A ...), medians.

Used to show that a refactor changed no speed (issue 30: "decode and cached-TTFT figures within
noise of before"). ``--base REV`` (and ``--head REV``, if given) is checked out into a temporary
git worktree; without ``--head`` the other arm is the working tree.

    PYTHONPATH=src .venv/bin/python bench/decode/revision_ab.py --base bb12f51 --samples 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, ROOT, machine, median, pyplot, save_png, write_json

# Run in the child with the arm's src/ first on sys.path: prints one JSON line.
CHILD = r"""
import json, random, sys, time
from kvreuse import LLM, SamplingParams
ctx, new, short, decode, reps = (int(a) for a in sys.argv[1:6])
llm = LLM("default")
rng = random.Random(0)
prefix = [rng.randrange(100, 40000) for _ in range(ctx)]
llm.generate([prefix], SamplingParams(max_tokens=1, temperature=0))  # the prefix cached (and warm-up)
ttft, tok_s = [], []
for r in range(reps):
    prompt = prefix + [rng.randrange(100, 40000) for _ in range(new)]
    t0 = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
    ttft.append(time.perf_counter() - t0)
    p = [rng.randrange(100, 40000) for _ in range(short)]
    t0 = time.perf_counter()
    out = llm.generate([p], SamplingParams(max_tokens=decode + 1, temperature=0, ignore_eos=True))[0]
    total = time.perf_counter() - t0
    tok_s.append(decode / (total - out.ttft_s))
ttft.sort(); tok_s.sort()
print(json.dumps({"cached_ttft_ms": ttft[len(ttft) // 2] * 1e3, "decode_tok_s": tok_s[len(tok_s) // 2]}))
"""


def sample(src: Path, args) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(args.context),
            str(args.new),
            str(args.short),
            str(args.decode),
            str(args.reps),
        ],
        env={**os.environ, "PYTHONPATH": str(src), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="git revision of the A arm (B: the working tree)")
    ap.add_argument("--head", default=None, help="git revision of the B arm (default: the working tree)")
    ap.add_argument("--samples", type=int, default=5, help="subprocesses per arm (medians over them)")
    ap.add_argument("--reps", type=int, default=3, help="measurements inside each subprocess (median)")
    ap.add_argument("--context", type=int, default=2048, help="cached prefix tokens")
    ap.add_argument("--new", type=int, default=32, help="new tokens after the cached prefix")
    ap.add_argument("--short", type=int, default=16, help="prompt tokens before the decode")
    ap.add_argument("--decode", type=int, default=128, help="tokens decoded")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"base": args.base, "head": args.head}  # a revision checked out, or None: this tree
        for name, rev in trees.items():
            if rev is not None:
                subprocess.run(
                    ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", f"{tmp}/{name}", rev], check=True
                )
        try:
            arms = {name: (Path(tmp) / name if rev else ROOT) / "src" for name, rev in trees.items()}
            results: dict[str, list[dict]] = {"base": [], "head": []}
            for i in range(args.samples):
                for name in ("base", "head") if i % 2 == 0 else ("head", "base"):
                    results[name].append(sample(arms[name], args))
                    print(i, name, results[name][-1], flush=True)
        finally:
            for name, rev in trees.items():
                if rev is not None:
                    subprocess.run(
                        ["git", "-C", str(ROOT), "worktree", "remove", "--force", f"{tmp}/{name}"], check=False
                    )
    summary = {
        arm: {k: median([s[k] for s in rs]) for k in ("cached_ttft_ms", "decode_tok_s")} for arm, rs in results.items()
    }
    ratio = {k: summary["head"][k] / summary["base"][k] for k in ("cached_ttft_ms", "decode_tok_s")}
    doc = {"machine": machine(), "args": vars(args), "samples": results, "median": summary, "head_over_base": ratio}
    print(json.dumps({"median": summary, "head_over_base": ratio}, indent=1))
    out = RESULTS / f"revision_ab{args.tag}.json"
    write_json(out, doc)
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, key, label in zip(
        axes,
        ("decode_tok_s", "cached_ttft_ms"),
        ("decode, batch 1 (tok/s)", f"cached {args.context} + {args.new} TTFT (ms)"),
    ):
        for x, arm in enumerate(("base", "head")):
            ys = [s[key] for s in results[arm]]
            ax.scatter([x] * len(ys), ys, alpha=0.6)
            ax.hlines(summary[arm][key], x - 0.2, x + 0.2)
        ax.set_xticks([0, 1], [args.base[:10], (args.head or "working tree")[:12]])
        ax.set_title(label)
    save_png(fig, out.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
