"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer`` from the
``ai-dynamo-runtime`` wheel) as a subprocess that follows kvreuse executors' ZMQ KV events,
and a router that sends each request where the indexer's ``POST /query`` scores highest.

Dynamo is not a kvreuse dependency: point ``KVREUSE_DYNAMO_PYTHON`` at a Python that has it
(``python3 -m venv /tmp/dyn && /tmp/dyn/bin/pip install ai-dynamo-runtime==1.6.1``; the wheel
is manylinux_2_28 x86_64, CPU-only is fine). The indexer takes ``--workers
"ID=tcp://HOST:PORT,..."`` (each executor's PUB endpoint), decodes vLLM-format batches
(``lib/kv-router/src/zmq_wire.rs``), keys blocks by a hash of their token ids, and answers
``{"token_ids": [...], "model_name": "default"}`` with ``{"scores": {ID: {dp_rank: n}}}``.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

DYNAMO_PYTHON_ENV = "KVREUSE_DYNAMO_PYTHON"


def dynamo_python() -> str | None:
    """``$KVREUSE_DYNAMO_PYTHON`` when that interpreter imports ``dynamo.llm``, else None."""
    python = os.environ.get(DYNAMO_PYTHON_ENV)
    if not python:
        return None
    probe = subprocess.run([python, "-c", "import dynamo.llm"], capture_output=True, timeout=120)
    return python if probe.returncode == 0 else None


@contextmanager
def running_indexer(python: str, port: int, workers: Mapping[int, str], block_size: int, log: Path) -> Iterator[str]:
    """The indexer on ``port`` following ``workers`` (instance id -> ZMQ PUB endpoint); yields
    its URL once ``GET /workers`` lists them all; terminated afterwards."""
    spec = ",".join(f"{wid}={endpoint}" for wid, endpoint in workers.items())
    cmd = [python, "-m", "dynamo.indexer", "--block-size", str(block_size), "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen([*cmd, "--threads", "1", "--workers", spec], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited with {proc.returncode}:\n{log.read_text()}")
            try:
                listed = httpx.get(f"{url}/workers", timeout=2).json()
                if {w["instance_id"] for w in listed} == set(workers):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"dynamo.indexer did not come up:\n{log.read_text()}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def scores(indexer: str, token_ids: list[int]) -> dict[int, int]:
    """Instance id -> the indexer's overlap score for ``token_ids`` (best dp rank)."""
    r = httpx.post(f"{indexer}/query", json={"token_ids": token_ids, "model_name": "default"}, timeout=10)
    r.raise_for_status()
    return {int(wid): max(ranks.values()) for wid, ranks in r.json()["scores"].items()}


def route_prefix_groups(
    indexer: str,
    executors: Mapping[int, str],
    complete: Callable[[str, list[int]], int],
    *,
    groups: int = 4,
    requests: int = 40,
    prefix_tokens: int = 256,
    suffix_tokens: int = 20,
    seed: int = 0,
    settle_s: float = 1.0,
) -> dict:
    """Warm ``groups`` shared prefixes, group g on executor ``ids[g % len(ids)]`` (its holder),
    then send ``requests`` (group i % groups, a fresh suffix each) to the instance the indexer
    scores highest (no score anywhere: round robin). ``complete(url, prompt)`` runs one and
    returns its cached tokens. Returns per-request choices and the share sent to the holder."""
    rng = random.Random(seed)
    ids = sorted(executors)
    prefixes = [[rng.randrange(200, 49000) for _ in range(prefix_tokens)] for _ in range(groups)]
    holder = {g: ids[g % len(ids)] for g in range(groups)}
    for g, prefix in enumerate(prefixes):
        complete(executors[holder[g]], prefix + [rng.randrange(200, 49000) for _ in range(8)])
    time.sleep(settle_s)  # events are batched every 20 ms; the indexer applies them as they come
    rows = []
    for i in range(requests):
        g = i % groups
        prompt = prefixes[g] + [rng.randrange(200, 49000) for _ in range(suffix_tokens)]
        found = scores(indexer, prompt)
        best = max(found.values(), default=0)
        tied = sorted(wid for wid, s in found.items() if s == best) if best > 0 else ids
        chosen = tied[i % len(tied)]
        cached = complete(executors[chosen], prompt)
        rows.append({"group": g, "holder": holder[g], "chosen": chosen, "scores": found, "cached_tokens": cached})
    to_holder = sum(r["chosen"] == r["holder"] for r in rows)
    return {"requests": rows, "to_holder": to_holder, "share_to_holder": to_holder / len(rows)}
