"""``kvreuse schema``: precompute PML schemas locally (into ``--schema-dir``) or on a server.

::

    kvreuse schema precompute FILE.xml --schema-dir DIR [--model default] [--src-dir D]
    kvreuse schema precompute FILE.xml --url http://127.0.0.1:8000     # POST /v1/schemas
    kvreuse schema list --url URL
    kvreuse schema delete NAME --url URL

A local precompute shows a progress bar per module and writes the module KV that
``kvreuse serve --schema-dir DIR`` (same model, same dtype) loads at start. Exit status 2
for a bad file, bad markup (the message names line/column or the module) or an HTTP error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    from kvreuse.engine.config import EngineConfig as C  # the engine flags' defaults, as serve's (imports no torch)

    p = argparse.ArgumentParser(prog="kvreuse schema", description="PML schemas: precompute, list, delete")
    sub = p.add_subparsers(dest="action", required=True)
    pre = sub.add_parser("precompute", help="encode every module of a schema once")
    pre.add_argument("file", help="PML schema file (<schema name=...>)")
    pre.add_argument("--src-dir", default=None, help="folder for <module src=...> files (default: the file's)")
    pre.add_argument("--schema-dir", default=C.schema_dir, help="write module KV here (what serve --schema-dir loads)")
    pre.add_argument("--url", default=None, help="precompute on a running server instead (POST /v1/schemas)")
    pre.add_argument("--model", default=C.model)
    pre.add_argument("--dtype", default=C.dtype, help="as the server's --dtype (module files are keyed to it)")
    pre.add_argument(
        "--quantization",
        default=C.quantization,
        choices=["auto", "none", "int8", "int4"],
        help="as the server's --quantization (module files are keyed to it)",
    )
    pre.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=C.deterministic,
        help="as the server's --[no-]deterministic (module files are keyed to it; default: auto, as serve)",
    )
    pre.add_argument("--device", default=C.device)
    pre.add_argument("--kv-cache-memory", type=float, default=C.kv_cache_memory_gib, metavar="GIB")
    pre.add_argument("--block-size", type=int, default=C.block_size)
    pre.add_argument("--max-model-len", type=int, default=C.max_model_len)
    pre.add_argument(
        "--schema-max-tokens",
        type=int,
        default=C.schema_max_tokens,
        help=f"as the server's (default: {C.schema_max_tokens})",
    )
    pre.add_argument(
        "--schema-max-bytes",
        type=int,
        default=C.schema_max_bytes,
        help=f"as the server's (default: {C.schema_max_bytes})",
    )
    for name in ("list", "delete"):
        q = sub.add_parser(name, help=f"{name} schemas on a running server")
        if name == "delete":
            q.add_argument("name")
        q.add_argument("--url", required=True)
    for q in sub.choices.values():
        q.add_argument("--api-key", default=None)
    return p


def _http(method: str, url: str, api_key: str | None, body: dict | None = None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        # precompute can take minutes on a CPU; connecting must not
        r = httpx.request(method, url, json=body, headers=headers, timeout=httpx.Timeout(600.0, connect=10.0))
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach the server at {url}: {exc} (is `kvreuse serve` running there?)") from None
    try:
        payload = r.json()
    except ValueError:
        raise ValueError(f"{url} answered {r.status_code} without JSON: {r.text[:200]}") from None
    if r.status_code != 200:
        raise ValueError(payload.get("error", {}).get("message", r.text))
    return payload


def _engine_config(args: argparse.Namespace):
    from kvreuse.engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        quantization=args.quantization,
        deterministic=args.deterministic,
        kv_cache_memory_gib=args.kv_cache_memory,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        schema_dir=args.schema_dir,
        schema_max_tokens=args.schema_max_tokens,
        schema_max_bytes=args.schema_max_bytes,
    )


def _precompute_local(args: argparse.Namespace, text: str, src_dir: str) -> dict:
    from tqdm import tqdm

    from kvreuse.cli import _load_model
    from kvreuse.engine.llm_engine import LLMEngine

    config = _engine_config(args)
    engine = LLMEngine(config, _load_model(args.model, config.dtype, config.device, config.quantization))
    with tqdm(desc="precomputing modules", unit="module", file=sys.stderr) as bar:

        def progress(done: int, total: int, name: str) -> None:
            bar.total = total
            bar.set_postfix_str(name or "<root>")
            bar.update(done - bar.n)

        return engine.modules.register(text, src_dir=src_dir, progress=progress).to_json()


def schema_main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(list(argv))
    try:
        if args.action == "precompute":
            path = Path(args.file)
            text = path.read_text(encoding="utf-8")
            src_dir = args.src_dir or str(path.parent)
            start = time.perf_counter()
            if args.url:
                out = _http("POST", args.url.rstrip("/") + "/v1/schemas", args.api_key, {"schema": text})
            else:
                if args.schema_dir is None:
                    print(
                        "kvreuse schema: no --schema-dir: the KV is computed and dropped (a dry run)", file=sys.stderr
                    )
                out = _precompute_local(args, text, src_dir)
            out["seconds"] = round(time.perf_counter() - start, 3)
        elif args.action == "list":
            out = _http("GET", args.url.rstrip("/") + "/v1/schemas", args.api_key)
        else:
            out = _http("DELETE", args.url.rstrip("/") + f"/v1/schemas/{args.name}", args.api_key)
    except (OSError, ValueError) as exc:
        print(f"kvreuse schema: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2))
    return 0
