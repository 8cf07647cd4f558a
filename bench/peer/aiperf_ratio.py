"""kvreuse serve vs llama-server under load, measured by NVIDIA's AIPerf (issue 32: "your own
light load generator, plus aiperf for a ratio"), on the same GGUF.

AIPerf is bench-only and heavy (pandas, pyarrow, its own prometheus_client): install it in a
venv of its own, never kvreuse's, and give its ``aiperf`` binary here::

    python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0
    LLAMA_SERVER=/path/to/llama-server PYTHONPATH=src .venv/bin/python bench/peer/aiperf_ratio.py \\
        --aiperf /tmp/aiperf-venv/bin/aiperf [--concurrency 4 16] [--rounds 3] [--llama-server-args ...]

Both servers run at once (``peer_server.py``'s helpers); for each ``--concurrency`` N and each
round, the servers in rotating order, AIPerf sends ``--requests`` streaming
``/v1/completions`` requests, N at a time: a shared ``--system``-token system prompt
(``--shared-system-prompt-length``) + ``--user`` synthetic tokens, ``--out`` tokens out with
``ignore_eos``, tokenized with the model's own tokenizer. Read from AIPerf's JSON export: ITL and
TTFT p50/p99 and output token throughput; medians over the rounds, and kvreuse / llama-server
ratios. Every round draws fresh prompts (its own ``--random-seed``; the two servers of a round
get the same ones), so no round is served from an earlier round's cache. Writes
bench/results/aiperf_ratio<tag>.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, free_port, machine, median, pyplot, running_server, save_png, write_json
from bench.peer.peer_server import default_gguf, llama_server

KVREUSE, LLAMA = "kvreuse", "llama-server"
METRICS = {  # our name -> (AIPerf metric tag, statistic)
    "itl_p50_ms": ("inter_token_latency", "p50"),
    "itl_p99_ms": ("inter_token_latency", "p99"),
    "ttft_p50_ms": ("time_to_first_token", "p50"),
    "ttft_p99_ms": ("time_to_first_token", "p99"),
    "output_tok_s": ("output_token_throughput", "avg"),
}


def tokenizer_dir(model: Path) -> str:
    """The folder of the tokenizer kvreuse converted from the GGUF (AIPerf needs a HF one)."""
    from kvreuse.models.loader import load_model

    loaded = load_model(str(model))
    folder = Path(tempfile.mkdtemp(prefix="aiperf_tok_"))
    loaded.tokenizer.save_pretrained(folder)
    return str(folder)


def aiperf(binary: str, url: str, tokenizer: str, conc: int, seed: int, args, out_dir: Path) -> dict[str, float]:
    """One AIPerf profile run over the prompts of ``seed``; the figures of ``METRICS`` from its
    JSON export. Each round needs its own seed: AIPerf draws the same prompts (system prompt and
    user text) from the same seed, and a server would serve a repeated round from its cache."""
    cmd = [
        binary,
        "profile",
        "--model",
        "m",
        "--url",
        url,
        "--endpoint-type",
        "completions",
        "--streaming",
        "--tokenizer",
        tokenizer,
        "--concurrency",
        str(conc),
        "--request-count",
        str(args.requests),
        "--warmup-request-count",
        str(conc),
        "--shared-system-prompt-length",
        str(args.system),
        "--prompt-input-tokens-mean",
        str(args.user),
        "--prompt-input-tokens-stddev",
        "0",
        "--prompt-output-tokens-mean",
        str(args.out),
        "--prompt-output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--extra-inputs",
        "temperature:0",
        "--random-seed",
        str(seed),
        "--ui-type",
        "none",
        "--no-auto-plot",
        "--output-artifact-dir",
        str(out_dir),
    ]
    # AIPerf 0.13 in offline mode resolves a tokenizer through the hub cache only, never a local
    # folder; online mode loads the folder without any network access
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s, env=env)
    exports = sorted(out_dir.rglob("profile_export_aiperf.json"))
    if done.returncode != 0 or not exports:
        raise RuntimeError(f"aiperf failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    doc = json.loads(exports[0].read_text())
    out: dict[str, float] = {}
    for name, (tag, stat) in METRICS.items():
        record = doc.get(tag) or next((r for r in doc.get("records", []) if r.get("tag") == tag), None)
        if record is None or record.get(stat) is None:
            raise RuntimeError(f"aiperf's export {exports[0]} has no {tag}.{stat}: keys {sorted(doc)[:20]}")
        out[name] = float(record[stat])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiperf", required=True, help="the aiperf binary (its own venv)")
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--model-file", type=Path, default=None, help="a GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--llama-server-args", default="", help="extra llama-server flags (say so beside the figure)")
    ap.add_argument("--kvreuse-args", default="")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4])
    ap.add_argument("--requests", type=int, default=12, help="requests per AIPerf run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system", type=int, default=1500)
    ap.add_argument("--user", type=int, default=128)
    ap.add_argument("--out", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=1800)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still stops its servers
    if not args.llama_server or not Path(args.llama_server).is_file():
        ap.error("--llama-server (or $LLAMA_SERVER): the binary, built as docs/benchmarks.md says")
    model = (args.model_file or default_gguf()).resolve()
    tok = tokenizer_dir(model)
    logs = Path(tempfile.mkdtemp(prefix="aiperf_ratio_"))
    runs: dict[str, dict[str, list[dict[str, float]]]] = {}
    t0 = time.time()
    with ExitStack() as stack:
        urls = {
            LLAMA: stack.enter_context(
                llama_server(
                    Path(args.llama_server),
                    model,
                    ["--alias", "m", *shlex.split(args.llama_server_args)],
                    logs / "llama.log",
                    1800,
                )
            ),
            KVREUSE: stack.enter_context(
                running_server(
                    free_port(),
                    ["--model", str(model), "--served-model-name", "m", *shlex.split(args.kvreuse_args)],
                    logs / "kvreuse.log",
                    1800,
                )
            ),
        }
        for conc in args.concurrency:
            runs[str(conc)] = {KVREUSE: [], LLAMA: []}
            for rnd in range(args.rounds):
                for name in [KVREUSE, LLAMA][rnd % 2 :] + [KVREUSE, LLAMA][: rnd % 2]:
                    seed = 1000 * conc + rnd  # both servers get the same fresh prompts in a round
                    r = aiperf(args.aiperf, urls[name], tok, conc, seed, args, logs / f"{name}_{conc}_{rnd}")
                    runs[str(conc)][name].append(r)
                    print(f"c{conc} round {rnd} {name:>12}: " + "  ".join(f"{k} {v:.1f}" for k, v in r.items()))
    summary = {
        conc: {name: {k: median([r[k] for r in rs]) for k in METRICS} for name, rs in arms.items()}
        for conc, arms in runs.items()
    }
    ratio = {conc: {k: s[KVREUSE][k] / s[LLAMA][k] for k in METRICS} for conc, s in summary.items()}
    print(json.dumps({"median": summary, "kvreuse_over_llama_server": ratio}, indent=1))
    out = RESULTS / f"aiperf_ratio{args.tag}.json"
    write_json(
        out,
        {
            "machine": machine(),
            "args": {k: str(v) for k, v in vars(args).items()},
            "model": str(model),
            "runs": runs,
            "median": summary,
            "kvreuse_over_llama_server": ratio,
            "minutes": (time.time() - t0) / 60,
        },
    )
    plt = pyplot()
    keys = ["itl_p50_ms", "itl_p99_ms", "ttft_p50_ms", "output_tok_s"]
    fig, axes = plt.subplots(1, len(keys), figsize=(13, 3.5))
    for ax, key in zip(axes, keys):
        concs = list(summary)
        for i, name in enumerate((LLAMA, KVREUSE)):
            ax.bar([x + 0.4 * i for x in range(len(concs))], [summary[c][name][key] for c in concs], 0.4, label=name)
        ax.set_xticks([x + 0.2 for x in range(len(concs))], [f"{c} streams" for c in concs])
        ax.set_title(key)
    axes[0].legend()
    fig.suptitle("AIPerf against both servers (medians over rounds)")
    save_png(fig, out.with_suffix(".png"))
    print(out)


if __name__ == "__main__":
    main()
