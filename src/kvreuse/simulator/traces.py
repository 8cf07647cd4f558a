"""Trace readers: turn a request trace into ``TraceRequest`` records with block keys.

Keys come from the shared hash (``kvreuse.cache.hashing``), so a simulated hit is exactly the
hit the engine would see. Two input formats (see ``docs/simulator.md``):

* **Mooncake** (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``): each
  hash id stands for one ``block_tokens``-token block and is hashed as a one-token block
  (``hash_block(parent, [hash_id])``), so the chain of keys is a chain of prefixes. The
  last id of a prompt whose length is not a multiple of ``block_tokens`` covers a partial
  block, which is never cached (SPEC section 2), so it gets no key.
* **kvreuse JSONL**: ``prompt_token_ids`` (or ``text``, tokenised as UTF-8 bytes),
  ``output_length``, optional ``timestamp`` (ms), ``cache_salt`` and
  ``kv_cache_retention_config``; keys are ``hash_token_blocks`` over the tokens.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvreuse.cache.hashing import BlockHash, hash_block, hash_token_blocks
from kvreuse.cache.kv_block import cdiv
from kvreuse.cache.retention import KvCacheRetentionConfig

MOONCAKE_MODEL_ID = "mooncake-trace"  # model identity folded into the first block's key


@dataclass(frozen=True, slots=True)
class TraceRequest:
    block_keys: tuple[BlockHash, ...]  # keys of the prompt's full blocks, in chain order
    block_tokens: tuple[tuple[int, ...], ...]  # stored tokens of those blocks (checked on a hit)
    prompt_tokens: int  # prompt length in tokens (may end in a partial block)
    output_tokens: int  # tokens generated
    timestamp_s: float  # arrival time in seconds (drives retention expiry)
    retention: KvCacheRetentionConfig | None = None


@dataclass(frozen=True, slots=True)
class Trace:
    requests: tuple[TraceRequest, ...]
    block_size: int  # tokens per block of the pool replaying this trace
    name: str

    @property
    def num_block_lookups(self) -> int:
        """Prompt blocks looked up over the whole trace (the replay's unit of work)."""
        return sum(cdiv(r.prompt_tokens, self.block_size) for r in self.requests)

    @property
    def num_kv_blocks(self) -> int:
        """Blocks every request of the trace allocates, summed: a pool this large never
        evicts (the infinite-cache bound)."""
        return sum(cdiv(r.prompt_tokens + max(r.output_tokens - 1, 0), self.block_size) for r in self.requests)


def read_trace(path: str | Path, *, block_tokens: int, trace_format: str = "auto", limit: int | None = None) -> Trace:
    """Read a Mooncake or kvreuse JSONL trace. ``trace_format`` is ``mooncake``, ``jsonl``
    or ``auto`` (decided by the first line's fields). Raises ``ValueError`` naming the line
    for malformed input."""
    path = Path(path)
    if block_tokens < 1:
        raise ValueError(f"--trace-block-tokens must be >= 1, got {block_tokens}")
    if limit is not None and limit < 1:
        raise ValueError(f"--limit must be >= 1, got {limit}")
    lines = _json_lines(path, limit)
    if trace_format == "auto":
        first = next(iter(lines), None)
        trace_format = "mooncake" if first is not None and "hash_ids" in first[1] else "jsonl"
    readers = {"mooncake": _mooncake_requests, "jsonl": _jsonl_requests}
    if trace_format not in readers:
        raise ValueError(f"unknown trace format {trace_format!r}: --trace-format accepts {sorted(readers)} or auto")
    return Trace(tuple(readers[trace_format](lines, block_tokens)), block_tokens, path.name)


def _json_lines(path: Path, limit: int | None) -> list[tuple[int, dict]]:
    out = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object per line")
            out.append((lineno, obj))
            if limit is not None and len(out) >= limit:
                break
    return out


def _mooncake_requests(lines: list[tuple[int, dict]], block_tokens: int) -> Iterator[TraceRequest]:
    memo: dict[tuple[BlockHash | None, int], BlockHash] = {}  # shared prefixes hash once
    for lineno, obj in lines:
        try:
            ids = [int(h) for h in obj["hash_ids"]]
            prompt, output = int(obj["input_length"]), int(obj["output_length"])
            ts = float(obj.get("timestamp", 0)) / 1000.0
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"line {lineno}: bad Mooncake record ({e!r})") from None
        if prompt < 1 or output < 0:
            raise ValueError(f"line {lineno}: input_length must be >= 1 and output_length >= 0")
        n_full = min(len(ids), prompt // block_tokens)
        keys: list[BlockHash] = []
        parent: BlockHash | None = None
        for depth, hid in enumerate(ids[:n_full]):
            key = memo.get((parent, hid))
            if key is None:
                extra = (MOONCAKE_MODEL_ID,) if depth == 0 else ()
                key = memo[(parent, hid)] = hash_block(parent, (hid,), extra)
            keys.append(key)
            parent = key
        yield TraceRequest(tuple(keys), tuple((h,) for h in ids[:n_full]), prompt, output, ts)


def _jsonl_requests(lines: list[tuple[int, dict]], block_size: int) -> Iterator[TraceRequest]:
    for i, (lineno, obj) in enumerate(lines):
        where = f"line {lineno}"
        if "prompt_token_ids" in obj:
            tokens = obj["prompt_token_ids"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ValueError(f"{where}: prompt_token_ids must be a list of integers")
        elif isinstance(obj.get("text"), str):
            tokens = list(obj["text"].encode("utf-8"))
        else:
            raise ValueError(f"{where}: needs prompt_token_ids (list of ints) or text (string)")
        output = obj.get("output_length", 0)
        if not isinstance(output, int) or output < 0:
            raise ValueError(f"{where}: output_length must be an integer >= 0")
        retention = None
        if obj.get("kv_cache_retention_config") is not None:
            try:
                retention = KvCacheRetentionConfig.from_dict(obj["kv_cache_retention_config"])
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
        stamp = obj.get("timestamp")
        if stamp is not None and (isinstance(stamp, bool) or not isinstance(stamp, (int, float))):
            raise ValueError(f"{where}: timestamp must be a number of milliseconds, got {stamp!r}")
        ts = float(stamp) / 1000.0 if stamp is not None else float(i)  # default: one request a second
        keys = hash_token_blocks(
            tokens, block_size, model_id=str(obj.get("model", "sim")), cache_salt=obj.get("cache_salt")
        )
        chunks = tuple(tuple(tokens[j * block_size : (j + 1) * block_size]) for j in range(len(keys)))
        yield TraceRequest(tuple(keys), chunks, len(tokens), output, ts, retention)
