"""Prompt-caching breakpoints (Anthropic's ``cache_control``) -> token-range retention and usage.

A client marks up to ``MAX_BREAKPOINTS`` blocks with ``{"type": "ephemeral", "ttl": "5m" | "1h"}``,
in the order tools -> system -> messages. kvreuse caches every full prompt block anyway, so a
breakpoint never changes *what* is cached: it changes what survives pressure. Each breakpoint
turns the prompt's tokens since the previous breakpoint into retention ranges, one per
``Segment`` (the tools and system head, a document, a history message), whose priority comes
from what the segment covers and whose duration from the breakpoint's ``ttl``::

    segments   [tools+system 0-40) [doc 40-90) [user 90-120) [assistant 120-150) [user 150-170)
    breakpoints          ^1h                          ^5m                                  (none)
    ranges     [0,40) p95 1h       [40,90) p50 5m [90,120) p40 5m             (defaults after 120)

The default priorities follow the TensorRT-LLM write-up's layers (tools 90-100, system 80-90,
RAG context 40-60, conversation history 20-40), each at or above kvreuse's default of 35 for
unmarked blocks, so a marked block never goes before an unmarked one of the same age; a
server may set its own (``BreakpointPolicy``).

Usage is counted as Anthropic counts it (``CachePlan.usage``): tokens served from the cache
(any tier) are read; the full blocks computed now up to the last breakpoint are written, split
by the ``ttl`` of the range holding each token; the rest is plain input. The three add up to
the prompt's tokens. Pure: no engine, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kvreuse.cache.retention import MAX_PRIORITY, MIN_PRIORITY, KvCacheRetentionConfig, TokenRangeRetentionConfig

MAX_BREAKPOINTS = 4  # Anthropic's limit per request
TTLS = ("5m", "1h")  # Anthropic's ttl values; "5m" is the default
KINDS = ("tools", "system", "document", "history")  # what a segment of the prompt can cover

DEFAULT_PRIORITIES: Mapping[str, int] = MappingProxyType({"tools": 95, "system": 85, "document": 50, "history": 40})
DEFAULT_DURATIONS_MS: Mapping[str, int] = MappingProxyType({"5m": 5 * 60_000, "1h": 60 * 60_000})


@dataclass(frozen=True)
class Segment:
    """A stretch ``[token_start, token_end)`` of the rendered prompt and what it covers (a
    subset of ``KINDS``: the first rendered message covers the tools too when there are any)."""

    kinds: frozenset[str]
    token_start: int
    token_end: int


@dataclass(frozen=True)
class Breakpoint:
    """A ``cache_control`` placed at the end of ``segments[segment]``; ``param`` is the request
    field it came from (``system[1].cache_control``), named in errors."""

    segment: int
    ttl: str
    param: str


def check_breakpoints(breakpoints: Sequence[Breakpoint]) -> None:
    """Anthropic's rules, in request order: at most ``MAX_BREAKPOINTS``, each ttl one of
    ``TTLS``, and no ``"1h"`` after a ``"5m"`` (a longer-lived prefix cannot sit behind a
    shorter-lived one). Raises ``ValueError`` whose message starts with the offending field."""
    if len(breakpoints) > MAX_BREAKPOINTS:
        extra = breakpoints[MAX_BREAKPOINTS]
        raise ValueError(
            f"{extra.param}: a request may have at most {MAX_BREAKPOINTS} blocks with cache_control, "
            f"got {len(breakpoints)}"
        )
    seen_short = None
    for bp in breakpoints:
        if bp.ttl not in TTLS:
            raise ValueError(f"{bp.param}.ttl: must be one of {', '.join(TTLS)}, got {bp.ttl!r}")
        if bp.ttl == "5m":
            seen_short = seen_short or bp
        elif seen_short is not None:
            raise ValueError(
                f"{bp.param}.ttl: a 1h cache_control may not follow a 5m one "
                f"({seen_short.param}); put the longer-lived breakpoints first"
            )


@dataclass(frozen=True)
class CacheUsage:
    """A response's prompt tokens as Anthropic counts them; ``input_tokens`` +
    ``cache_read_input_tokens`` + ``cache_creation_input_tokens`` = the prompt's tokens."""

    input_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int
    ephemeral_5m_input_tokens: int
    ephemeral_1h_input_tokens: int


@dataclass(frozen=True)
class CachePlan:
    """The retention ranges of one prompt and the ``ttl`` of each (same order)."""

    ranges: tuple[TokenRangeRetentionConfig, ...] = ()
    ttls: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()  # the kind that gave each range its priority (metrics' class label)

    def tokens_by_class(self) -> list[tuple[str, str, int]]:
        """``(class, ttl, tokens)`` of each range, for the per-class counters."""
        return [
            (c, t, (r.token_end or r.token_start) - r.token_start)
            for r, t, c in zip(self.ranges, self.ttls, self.classes)
        ]

    def retention(self) -> KvCacheRetentionConfig | None:
        """The request's ``KvCacheRetentionConfig`` (``None``: no breakpoint, the defaults)."""
        return KvCacheRetentionConfig(self.ranges) if self.ranges else None

    def usage(self, prompt_tokens: int, cached_tokens: int, block_size: int) -> CacheUsage:
        """Counts for a prompt of ``prompt_tokens`` of which ``cached_tokens`` (a prefix) were
        served from the cache. Written: the tokens from ``cached_tokens`` up to the last
        breakpoint's end rounded down to a block boundary (only full blocks are stored),
        each under its range's ttl."""
        end = max((r.token_end or prompt_tokens for r in self.ranges), default=0)
        stored_end = min(end, prompt_tokens) // block_size * block_size
        written = {"5m": 0, "1h": 0}
        for r, ttl in zip(self.ranges, self.ttls):
            lo, hi = max(r.token_start, cached_tokens), min(r.token_end or prompt_tokens, stored_end)
            written[ttl] += max(0, hi - lo)
        created = written["5m"] + written["1h"]
        return CacheUsage(prompt_tokens - cached_tokens - created, cached_tokens, created, written["5m"], written["1h"])


@dataclass(frozen=True)
class BreakpointPolicy:
    """Priorities per segment kind and durations per ttl (ms); a server's configuration."""

    priorities: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_PRIORITIES))
    durations_ms: Mapping[str, int] = field(default_factory=lambda: dict(DEFAULT_DURATIONS_MS))

    def __post_init__(self) -> None:
        if set(self.priorities) != set(KINDS):
            raise ValueError(f"breakpoint priorities: give exactly {', '.join(KINDS)}, got {sorted(self.priorities)}")
        for kind, p in self.priorities.items():
            if not isinstance(p, int) or not MIN_PRIORITY <= p <= MAX_PRIORITY:
                raise ValueError(
                    f"breakpoint priorities: {kind} must be an integer in [{MIN_PRIORITY}, {MAX_PRIORITY}], got {p!r}"
                )
        if set(self.durations_ms) != set(TTLS) or any(
            not isinstance(d, int) or d <= 0 for d in self.durations_ms.values()
        ):
            raise ValueError(f"breakpoint durations: give a positive ms for each of {', '.join(TTLS)}")

    @classmethod
    def parse(cls, priorities: str | None = None, durations: str | None = None) -> BreakpointPolicy:
        """From ``--cache-control-priorities tools=95,system=85`` and ``--cache-control-ttls
        5m=300,1h=3600`` (seconds); what a spec leaves out keeps its default. Raises
        ``ValueError`` naming the flag."""
        found = {"--cache-control-priorities": dict(DEFAULT_PRIORITIES), "--cache-control-ttls": {}}
        for flag, spec, names in (
            ("--cache-control-priorities", priorities, KINDS),
            ("--cache-control-ttls", durations, TTLS),
        ):
            for item in (spec or "").split(","):
                name, sep, value = item.strip().partition("=")
                if not item.strip():
                    continue
                if not sep or name not in names or not value.strip().isdigit():
                    raise ValueError(
                        f"{flag} takes name=integer pairs (names {', '.join(names)}), got {item.strip()!r}"
                    )
                found[flag][name] = int(value)
        durations_ms = {**DEFAULT_DURATIONS_MS, **{k: v * 1000 for k, v in found["--cache-control-ttls"].items()}}
        try:
            return cls(found["--cache-control-priorities"], durations_ms)
        except ValueError as exc:
            raise ValueError(f"--cache-control-priorities / --cache-control-ttls: {exc}") from None

    def priority(self, kinds: frozenset[str]) -> int:
        """A segment's priority: the highest of the kinds it covers."""
        return max(self.priorities[k] for k in kinds)

    def plan(self, segments: Sequence[Segment], breakpoints: Sequence[Breakpoint]) -> CachePlan:
        """One range per non-empty segment up to the last breakpoint, each with the duration
        of the first breakpoint at or after it. ``breakpoints`` must have passed
        ``check_breakpoints``; they may come in any segment order (several on one segment
        count once, the earliest in request order giving the ttl)."""
        ttl_at: dict[int, str] = {}
        for bp in breakpoints:
            if not 0 <= bp.segment < len(segments):
                raise ValueError(f"{bp.param}: no segment {bp.segment} (the prompt has {len(segments)})")
            ttl_at.setdefault(bp.segment, bp.ttl)
        ranges, ttls, classes = [], [], []
        covered = 0  # segments before this index are planned
        for index in sorted(ttl_at):
            ttl = ttl_at[index]
            for seg in segments[covered : index + 1]:
                if seg.token_end > seg.token_start:
                    ranges.append(
                        TokenRangeRetentionConfig(
                            seg.token_start, seg.token_end, self.priority(seg.kinds), self.durations_ms[ttl]
                        )
                    )
                    ttls.append(ttl)
                    classes.append(max(sorted(seg.kinds), key=self.priorities.__getitem__))
            covered = max(covered, index + 1)
        return CachePlan(tuple(ranges), tuple(ttls), tuple(classes))


DEFAULT_POLICY = BreakpointPolicy()  # the write-up's priorities; 5 min and 1 h


PROMPT_CACHE_RETENTIONS = ("in_memory", "24h")  # OpenAI's prompt_cache_retention values
DAY_MS = 24 * 60 * 60_000


def prompt_cache_retention_config(value: str | None, policy: BreakpointPolicy | None = None) -> dict | None:
    """OpenAI's ``prompt_cache_retention`` as a ``kv_cache_retention_config`` (its JSON form):
    ``"24h"`` keeps the whole prompt at the history priority for 24 hours; ``"in_memory"`` (and
    none) is the default policy, ``None``. Raises ``ValueError`` naming the field otherwise."""
    if value is None or value == "in_memory":
        return None
    if value != "24h":
        raise ValueError(f"prompt_cache_retention: must be one of {', '.join(PROMPT_CACHE_RETENTIONS)}, got {value!r}")
    priority = (policy or BreakpointPolicy()).priorities["history"]
    return {
        "token_range_retention_configs": [
            {"token_start": 0, "token_end": None, "priority": priority, "duration_ms": DAY_MS}
        ]
    }
