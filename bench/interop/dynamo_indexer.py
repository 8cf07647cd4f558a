"""NVIDIA Dynamo's standalone KV indexer routing kvreuse executors from their ZMQ KV events.

Two ``kvreuse serve`` executors publish vLLM-format KV events (``--kv-events-endpoint``);
``python -m dynamo.indexer`` (ai-dynamo-runtime, installed outside kvreuse) follows both
sockets and nothing else. Four prefix groups are computed once each (two per executor); then
``--requests`` requests (group i % 4, a fresh suffix each) go to the executor the indexer's
``POST /query`` scores highest. Reported: the share sent to the group's holder and the cached
tokens each request got there.

    python3 -m venv /tmp/dyn && /tmp/dyn/bin/pip install ai-dynamo-runtime==1.6.1
    PYTHONPATH=src .venv/bin/python bench/interop/dynamo_indexer.py --dynamo-python /tmp/dyn/bin/python \
        [--model default] [--requests 40] [--prefix 256]

Writes bench/results/dynamo_indexer.json and .png.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import RESULTS, free_port, pyplot, running_servers, save_png, write_json
from tests.events.dynamo_indexer import route_prefix_groups, running_indexer
from tests.serve_client import complete

BLOCK = 16


def dynamo_version(python: str) -> str:
    code = "import importlib.metadata as m; print(m.version('ai-dynamo-runtime'))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dynamo-python", required=True, help="a Python with ai-dynamo-runtime installed")
    ap.add_argument("--model", default="default", help="kvreuse serve --model (default: SmolLM2-135M)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prefix", type=int, default=256, help="tokens of each group's shared prefix")
    ap.add_argument("--out", type=Path, default=RESULTS / "dynamo_indexer.json")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="dynamo-indexer-"))
    zmq_ports = {1: free_port(), 2: free_port()}
    serve = ["--model", args.model, "--served-model-name", "m", "--kv-cache-memory", "0.5", "--max-model-len", "2048"]
    servers = [
        (free_port(), [*serve, "--kv-events-endpoint", f"tcp://*:{zmq_ports[w]}"], work / f"executor-{w}.log")
        for w in (1, 2)
    ]
    with running_servers(servers) as urls:
        workers = {w: f"tcp://127.0.0.1:{p}" for w, p in zmq_ports.items()}
        with running_indexer(args.dynamo_python, free_port(), workers, BLOCK, work / "indexer.log") as indexer:
            result = route_prefix_groups(
                indexer,
                dict(zip((1, 2), urls)),
                lambda url, p: complete(url, p, max_tokens=1, model="m").cached_tokens,
                requests=args.requests,
                prefix_tokens=args.prefix,
            )
    doc = {
        "what": "Dynamo's standalone KV indexer routing two kvreuse executors from their ZMQ KV events",
        "dynamo": {"package": "ai-dynamo-runtime", "version": dynamo_version(args.dynamo_python)},
        "model": args.model,
        "block_size": BLOCK,
        "groups": 4,
        "prefix_tokens": args.prefix,
        **result,
    }
    path = write_json(args.out, doc)
    rows = result["requests"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.5))
    colors = ["tab:green" if r["chosen"] == r["holder"] else "tab:red" for r in rows]
    ax.bar(range(len(rows)), [r["cached_tokens"] for r in rows], color=colors)
    ax.set_xlabel("request (group = i mod 4); green: sent to the group's holder")
    ax.set_ylabel("cached tokens")
    ax.set_title(f"Dynamo indexer -> kvreuse: {result['to_holder']}/{len(rows)} to the holder ({args.model})")
    fig.tight_layout()
    save_png(fig, path.with_suffix(".png"))
    print(f"{result['to_holder']}/{len(rows)} requests to the holder; wrote {path}")
    return 0 if result["share_to_holder"] >= 0.9 else 1


if __name__ == "__main__":
    raise SystemExit(main())
