"""HTTP calls to a live ``kvreuse serve`` for tests and benches: one completion with its
usage, samples from /metrics, the block keys and disk files of a prompt, waiting for the
tier writer.

Everything goes through the server's public routes (``/v1/completions``, ``/metrics``,
``/v1/kvreuse/info``); nothing here reaches into a server process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvreuse.cache.hashing import BlockHash, hash_token_blocks


@dataclass(frozen=True)
class Completion:
    """One ``/v1/completions`` answer (a single prompt, ``n`` = 1)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    by_tier: dict[str, int]  # cached_tokens_by_tier ({} when the server has no tier below the device)
    seconds: float  # wall time of the whole call


def complete(
    url: str,
    prompt: list[int] | str,
    *,
    max_tokens: int = 1,
    salt: str | None = None,
    model: str | None = None,
    timeout_s: float = 600,
    client: httpx.Client | None = None,
) -> Completion:
    """A greedy completion of ``prompt``, exactly ``max_tokens`` long (``ignore_eos``); raises
    ``AssertionError`` with the body on a non-200."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if model is not None:
        body["model"] = model
    if salt is not None:
        body["cache_salt"] = salt
    started = time.perf_counter()
    r = (client or httpx).post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    seconds = time.perf_counter() - started
    assert r.status_code == 200, f"{r.status_code}: {r.text}"
    doc = r.json()
    details = doc["usage"]["prompt_tokens_details"]
    return Completion(
        doc["choices"][0]["text"],
        doc["choices"][0]["finish_reason"],
        doc["usage"]["prompt_tokens"],
        doc["usage"]["completion_tokens"],
        details["cached_tokens"],
        details.get("cached_tokens_by_tier", {}),
        seconds,
    )


def metric(url: str, name: str, **labels: str) -> float:
    """The value of sample ``name`` (e.g. ``kvreuse:disk_tier_events_total``) whose labels
    include ``labels``, summed over the rest; 0.0 when absent."""
    total = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def store_events(url: str, level: str) -> dict[str, float]:
    """The ``disk`` or ``remote`` store's counters (``puts``, ``hits``, ``corrupt``, ...)."""
    name = f"kvreuse:{level}_tier_events_total"
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels["event"]] = out.get(sample.labels["event"], 0.0) + sample.value
    return out


def wait_for_puts(url: str, level: str, at_least: float, timeout_s: float = 60) -> dict[str, float]:
    """Wait until the ``level`` store's ``puts`` + ``put_failures`` reach ``at_least`` (the
    background writer has handled that many blocks); returns its counters. Raises
    ``AssertionError`` on timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        events = store_events(url, level)
        if events.get("puts", 0) + events.get("put_failures", 0) >= at_least:
            return events
        assert time.monotonic() < deadline, f"the {level} store handled only {events} of {at_least} writes"
        time.sleep(0.05)


def block_keys(url: str, prompt: list[int], salt: str | None = None) -> list[BlockHash]:
    """The keys the server gives the full blocks of ``prompt`` (from ``/v1/kvreuse/info``)."""
    info = httpx.get(f"{url}/v1/kvreuse/info", timeout=30).json()
    return hash_token_blocks(
        prompt, info["block_size"], model_id=info["model_id"], cache_salt=salt, algorithm=info["hash_algorithm"]
    )


def block_file(disk_dir: Path, key: BlockHash) -> Path:
    """The disk tier's file of block ``key`` under ``disk_dir`` (any namespace folder)."""
    found = list(Path(disk_dir).glob(f"*/*/{bytes(key).hex()}.kvb"))
    assert len(found) == 1, f"block {bytes(key).hex()[:16]}: {len(found)} files under {disk_dir}"
    return found[0]


def flip_byte(path: Path) -> None:
    """Corrupt a block file on purpose: one byte in the middle of its KV flipped."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
