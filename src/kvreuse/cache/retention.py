"""Priority-based KV cache retention (TensorRT-LLM semantics, SPEC section 3).

A request's ``kv_cache_retention_config`` gives token ranges a priority (0-100) and an
optional duration; everything else gets ``DEFAULT_PRIORITY`` (35)::

    {"token_range_retention_configs": [
        {"token_start": 0, "token_end": 1000, "priority": 100, "duration_ms": 30000},
        {"token_start": 1000, "token_end": null, "priority": 50}],
     "decode_retention_priority": 30, "decode_duration_ms": 5000}

Ranges are half-open ``[token_start, token_end)``, sorted and non-overlapping; only the
last may be open (``token_end: null`` = to the end of the prompt). A block takes the
priority of the range holding its *first* token; blocks whose first token was generated
take the decode priority. This module only computes per-block retention; the block pool
applies it (``BlockPool.register`` / ``set_retention``) and runs eviction and expiry.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from kvreuse.cache.kv_block import DEFAULT_PRIORITY, cdiv

MIN_PRIORITY = 0
MAX_PRIORITY = 100
FIELD = "kv_cache_retention_config"  # the request field, named in every error

BlockRetention = tuple[int, float | None]
"""(priority, duration in seconds or ``None`` = holds until evicted) of one block."""


@dataclass(frozen=True, slots=True)
class TokenRangeRetentionConfig:
    token_start: int  # first token of the range (inclusive)
    token_end: int | None  # one past the last token; None = to the end of the prompt
    priority: int  # 0-100; higher is kept longer
    duration_ms: int | None = None  # how long the priority holds once released; None = forever

    def __post_init__(self) -> None:
        _check_range(self, "token_range_retention_config")

    def contains(self, token: int) -> bool:
        return self.token_start <= token and (self.token_end is None or token < self.token_end)


@dataclass(frozen=True, slots=True)
class KvCacheRetentionConfig:
    token_range_retention_configs: tuple[TokenRangeRetentionConfig, ...] = ()
    decode_retention_priority: int = DEFAULT_PRIORITY  # blocks of generated tokens
    decode_duration_ms: int | None = None

    def __post_init__(self) -> None:
        # Accept a list from Python callers but store a tuple so the config stays hashable.
        object.__setattr__(self, "token_range_retention_configs", tuple(self.token_range_retention_configs))
        _check_ranges(self.token_range_retention_configs, f"{FIELD}.token_range_retention_configs")
        _check_priority(self.decode_retention_priority, f"{FIELD}.decode_retention_priority")
        _check_duration(self.decode_duration_ms, f"{FIELD}.decode_duration_ms")

    @classmethod
    def from_dict(cls, d: object, path: str = FIELD) -> KvCacheRetentionConfig:
        """Parse the JSON request field. Raises ``ValueError`` whose message starts with
        the offending field path, e.g. ``kv_cache_retention_config.token_range_retention_configs[1].token_start``."""
        obj = _expect_mapping(
            d, path, {"token_range_retention_configs", "decode_retention_priority", "decode_duration_ms"}
        )
        raw_ranges = obj.get("token_range_retention_configs", [])
        if not isinstance(raw_ranges, list):
            raise ValueError(f"{path}.token_range_retention_configs: expected a list, got {type(raw_ranges).__name__}")
        ranges = []
        for i, r in enumerate(raw_ranges):
            rp = f"{path}.token_range_retention_configs[{i}]"
            item = _expect_mapping(r, rp, {"token_start", "token_end", "priority", "duration_ms"})
            for required in ("token_start", "priority"):
                if required not in item:
                    raise ValueError(f"{rp}.{required}: required")
            fields = {k: item.get(k) for k in ("token_start", "token_end", "priority", "duration_ms")}
            _check_range_fields(fields, rp)
            ranges.append(
                TokenRangeRetentionConfig(
                    token_start=item["token_start"],
                    token_end=item.get("token_end"),
                    priority=item["priority"],
                    duration_ms=item.get("duration_ms"),
                )
            )
        decode_priority = obj.get("decode_retention_priority", DEFAULT_PRIORITY)
        if decode_priority is None:
            decode_priority = DEFAULT_PRIORITY
        _check_priority(decode_priority, f"{path}.decode_retention_priority")
        decode_duration = obj.get("decode_duration_ms")
        _check_duration(decode_duration, f"{path}.decode_duration_ms")
        _check_ranges(ranges, f"{path}.token_range_retention_configs")
        return cls(tuple(ranges), decode_priority, decode_duration)


def as_retention(value: KvCacheRetentionConfig | Mapping[str, Any] | None) -> KvCacheRetentionConfig | None:
    """A request's retention as given at the edge (``LLM.generate``): ``None``, a config, or
    the JSON form (a mapping). Raises ``ValueError`` naming ``kv_cache_retention_config``
    for a bad mapping or any other type."""
    if value is None or isinstance(value, KvCacheRetentionConfig):
        return value
    if isinstance(value, Mapping):
        return KvCacheRetentionConfig.from_dict(value)
    raise ValueError(f"{FIELD}: expected a KvCacheRetentionConfig or a mapping, got {type(value).__name__}")


def checked_retention(value: KvCacheRetentionConfig | None) -> KvCacheRetentionConfig | None:
    """``value`` unchanged: the engine takes a config or ``None`` (the JSON form is converted
    once, at the edge, with ``as_retention``). Raises ``ValueError`` naming
    ``kv_cache_retention_config`` for anything else."""
    if value is None or isinstance(value, KvCacheRetentionConfig):
        return value
    raise ValueError(
        f"{FIELD}: expected a KvCacheRetentionConfig, got {type(value).__name__} "
        "(convert the JSON form with kvreuse.cache.retention.as_retention)"
    )


def decode_retention_priority(config: KvCacheRetentionConfig | None) -> int:
    """Priority of generated-token blocks (the default when there is no config)."""
    return DEFAULT_PRIORITY if config is None else config.decode_retention_priority


def decode_duration_ms(config: KvCacheRetentionConfig | None) -> int | None:
    """Duration of generated-token blocks in ms, ``None`` when they hold until evicted."""
    return None if config is None else config.decode_duration_ms


def block_priorities(
    config: KvCacheRetentionConfig | None,
    num_tokens: int,
    block_size: int,
    *,
    num_prompt_tokens: int | None = None,
) -> list[BlockRetention]:
    """(priority, duration_s) of each of the ``ceil(num_tokens / block_size)`` blocks, as a
    new block is registered with.

    A block whose first token is a prompt token (index < ``num_prompt_tokens``, default
    all of them) takes the range holding that token, else ``DEFAULT_PRIORITY`` with no
    duration; a block whose first token was generated takes the decode retention.
    Raises ``ValueError`` for a non-positive ``block_size`` or inconsistent counts.
    """
    return [
        (DEFAULT_PRIORITY if p is None else p, d)
        for p, d in requested_retention(config, num_tokens, block_size, num_prompt_tokens=num_prompt_tokens)
    ]


def requested_retention(
    config: KvCacheRetentionConfig | None,
    num_tokens: int,
    block_size: int,
    *,
    num_prompt_tokens: int | None = None,
) -> list[tuple[int | None, float | None]]:
    """Like ``block_priorities`` but ``None`` where the request gives no priority (no
    config, or a prompt block outside every range): what ``BlockPool.set_retention``
    takes for a *reused* block, which keeps its priority then but always gets the
    duration (``None`` clears it). Raises ``ValueError`` like ``block_priorities``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    prompt = num_tokens if num_prompt_tokens is None else num_prompt_tokens
    if not 0 <= prompt <= num_tokens:
        raise ValueError(f"num_prompt_tokens must be in [0, {num_tokens}], got {num_prompt_tokens}")
    n_blocks = cdiv(num_tokens, block_size)
    if config is None:
        return [(None, None)] * n_blocks
    ranges = config.token_range_retention_configs
    decode = (config.decode_retention_priority, _seconds(config.decode_duration_ms))
    out: list[tuple[int | None, float | None]] = []
    r = 0  # ranges are sorted and first tokens increase: one forward walk
    for first in range(0, num_tokens, block_size):
        if first >= prompt:
            out.append(decode)
            continue
        while r < len(ranges) and (end := ranges[r].token_end) is not None and end <= first:
            r += 1
        if r < len(ranges) and ranges[r].contains(first):
            out.append((ranges[r].priority, _seconds(ranges[r].duration_ms)))
        else:
            out.append((None, None))
    return out


def requested_block_retention(
    config: KvCacheRetentionConfig | None, first_token: int, *, num_prompt_tokens: int
) -> tuple[int | None, float | None]:
    """What ``requested_retention`` gives the one block whose first token is
    ``first_token``, without building the list for the blocks before it: the decode
    retention when that token was generated (index >= ``num_prompt_tokens``), else the
    range holding it, else ``(None, None)`` (also without a config). O(ranges)."""
    if config is None:
        return (None, None)
    if first_token >= num_prompt_tokens:
        return (config.decode_retention_priority, _seconds(config.decode_duration_ms))
    for r in config.token_range_retention_configs:
        if r.contains(first_token):
            return (r.priority, _seconds(r.duration_ms))
    return (None, None)


def ranges_from_message_boundaries(
    boundaries: Sequence[tuple[int, int]],
    retentions: Sequence[Mapping | None],
) -> KvCacheRetentionConfig | None:
    """Turn chat-message retention into token ranges, so users never count tokens.

    ``boundaries[i]`` is message i's ``(token_start, token_end)`` in the rendered prompt
    (sorted, non-overlapping); ``retentions[i]`` is its ``"retention"`` object
    (``{"priority": 90, "duration_ms": 30000}``) or ``None``. Each message with retention
    becomes one range over its own tokens (with leaves-only eviction the messages before
    it are kept at least as long, like a prompt-caching breakpoint). Empty messages are
    skipped. Returns ``None`` when no message has retention. Raises ``ValueError``
    naming ``messages[i].retention...`` for bad input.
    """
    if len(boundaries) != len(retentions):
        raise ValueError(f"messages: {len(boundaries)} boundaries but {len(retentions)} retentions")
    ranges = []
    for i, ((start, end), retention) in enumerate(zip(boundaries, retentions)):
        if retention is None or start == end:
            continue
        path = f"messages[{i}].retention"
        item = _expect_mapping(retention, path, {"priority", "duration_ms"})
        if "priority" not in item:
            raise ValueError(f"{path}.priority: required")
        _check_priority(item["priority"], f"{path}.priority")
        _check_duration(item.get("duration_ms"), f"{path}.duration_ms")
        ranges.append(TokenRangeRetentionConfig(start, end, item["priority"], item.get("duration_ms")))
    if not ranges:
        return None
    _check_ranges(ranges, "messages")
    return KvCacheRetentionConfig(tuple(ranges))


# ---------------------------------------------------------------------- validation
def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000.0


def _expect_mapping(obj: object, path: str, allowed: set[str]) -> Mapping:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{path}: expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ValueError(f"{path}.{unknown[0]}: unknown field (accepted: {sorted(allowed)})")
    return obj


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)  # JSON true is not a number


def _check_priority(v: object, path: str) -> None:
    if not _is_int(v) or not MIN_PRIORITY <= v <= MAX_PRIORITY:
        raise ValueError(f"{path}: must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {v!r}")


MAX_DURATION_MS = 10**12  # ~31.7 years; null means no expiry at all


def _check_duration(v: object, path: str) -> None:
    if v is not None and (not _is_int(v) or not 0 < v <= MAX_DURATION_MS):
        raise ValueError(f"{path}: must be a positive integer (ms) up to {MAX_DURATION_MS}, or null, got {v!r:.40}")


def _check_range_fields(f: Mapping, path: str) -> None:
    if not _is_int(f["token_start"]) or f["token_start"] < 0:
        raise ValueError(f"{path}.token_start: must be an integer >= 0, got {f['token_start']!r}")
    end = f["token_end"]
    if end is not None and (not _is_int(end) or end <= f["token_start"]):
        raise ValueError(
            f"{path}.token_end: must be an integer > token_start ({f['token_start']}) or null, got {end!r}"
        )
    _check_priority(f["priority"], f"{path}.priority")
    _check_duration(f["duration_ms"], f"{path}.duration_ms")


def _check_range(r: TokenRangeRetentionConfig, path: str) -> None:
    _check_range_fields(
        {"token_start": r.token_start, "token_end": r.token_end, "priority": r.priority, "duration_ms": r.duration_ms},
        path,
    )


def _check_ranges(ranges: Sequence[TokenRangeRetentionConfig], path: str) -> None:
    """Sorted, non-overlapping, only the last open. Names the later range of a bad pair."""
    for i in range(1, len(ranges)):
        prev, cur = ranges[i - 1], ranges[i]
        if prev.token_end is None:
            raise ValueError(f"{path}[{i - 1}].token_end: only the last range may be open (null)")
        if cur.token_start < prev.token_end:
            raise ValueError(
                f"{path}[{i}].token_start: ranges must be sorted and non-overlapping, "
                f"{cur.token_start} < previous token_end {prev.token_end}"
            )
