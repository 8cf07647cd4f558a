"""Routing policies: each is a small object that scores every candidate executor.

The router picks the candidate with the *lowest* score; ties go to a random one among
the tied (so equal executors share work instead of the first one taking it all). Adding a
policy is a few lines: write ``scores`` and register it in ``POLICIES``. A policy with
state (round robin's turn) changes it only when ``dry_run`` is false: ``/v1/route/explain``
scores with ``dry_run=True`` and must not change what the next request gets.

A ``Candidate`` carries what a policy may read: how many of the request's leading blocks
the executor holds (from the index), how many blocks the prompt has, and the executor's
current load in blocks (prompt blocks of the requests the router has in flight there,
plus what the executor's ``/metrics`` says is queued).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvreuse.events.records import DEVICE_LEVEL, DISK_LEVEL, HOST_LEVEL, OBJECT_LEVEL, REMOTE_LEVEL, TIER_NAMES

# One uncached block costs as much as 8 blocks of load elsewhere: measured on the Mooncake
# conversation trace (docs/benchmarks.md, "Router (simulator)"); 1 spreads prefixes too thin.
DEFAULT_OVERLAP_WEIGHT = 8.0


# How much of a recompute one cached block saves, by the tier holding it (the index's cache
# levels: vLLM's media). Measured by bench/tiers.py (docs/benchmarks.md, "Tiers"): weight =
# (recompute TTFT - tier TTFT) / (recompute TTFT - device-hit TTFT), rounded.
# 4,096-token prefix + 32, default model, fp32: device 0.259 s, host 0.286, disk 0.345,
# Redis on loopback 0.574, recompute 10.92 (bench/results/tiers.json).
# Object tier (S3), bench/tiers/tiers_object.py: 4,096-token prefix + 32, SeaweedFS's S3 gateway
# on loopback: device 2.93 s, object 9.73, recompute 138.4 (a machine at load ~10, run at nice
# 19: the absolute times are slow, the ratio is what counts; bench/results/tiers_object.json).
DEFAULT_TIER_WEIGHTS = {
    DEVICE_LEVEL: 1.0,
    HOST_LEVEL: 0.997,
    DISK_LEVEL: 0.992,
    REMOTE_LEVEL: 0.970,
    OBJECT_LEVEL: 0.950,
}
# what --tier-weights accepts: our names (device, host, ...) and the levels themselves, any case
TIER_ALIASES = {**{name: level for level, name in TIER_NAMES.items()}, **{level.lower(): level for level in TIER_NAMES}}


def parse_tier_weights(spec: str | None) -> dict[str, float]:
    """``device=1,host=0.9,disk=0.7,remote=0.6`` (levels by our or vLLM's names; unlisted
    levels keep their default) -> level -> weight. Raises ``ValueError`` naming
    ``--tier-weights`` for anything else (a weight must be a finite number in [0, 1])."""
    weights = dict(DEFAULT_TIER_WEIGHTS)
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        name, sep, value = item.partition("=")
        level = TIER_ALIASES.get(name.strip().lower()) or (name.strip() if name.strip() in weights else None)
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or level is None or not 0 <= weight <= 1:
            raise ValueError(
                f"--tier-weights takes level=weight pairs (levels device, host, disk, remote, object; "
                f"weights in [0, 1]), got {item.strip()!r}"
            )
        weights[level] = weight
    return weights


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    overlap_blocks: float  # leading prompt blocks the executor holds (index view), weighted by tier
    prompt_blocks: int  # full blocks of the prompt
    load_blocks: float  # active blocks (in flight, router's count) + queued blocks (executor's metrics)
    in_flight: int  # requests the router has in flight there

    @property
    def uncached_blocks(self) -> float:
        return self.prompt_blocks - self.overlap_blocks


@dataclass(frozen=True, slots=True)
class Decision:
    choice: str
    scores: dict[str, float]  # candidate name -> score (lower wins)


class RoutingPolicy(Protocol):
    name: str

    def scores(self, candidates: Sequence[Candidate], *, dry_run: bool = False) -> list[float]:
        """One score per candidate, in order; the lowest wins. With ``dry_run`` the policy's
        state is left as it was (the same call again gives the same scores)."""
        ...


def check_overlap_weight(overlap_weight: float) -> float:
    """``overlap_weight`` if it is a finite number >= 0, else ``ValueError`` naming
    ``--overlap-weight`` (NaN would make every score NaN and no candidate the lowest)."""
    if not math.isfinite(overlap_weight) or overlap_weight < 0:
        raise ValueError(f"--overlap-weight must be a finite number >= 0, got {overlap_weight}")
    return overlap_weight


class KVPolicy:
    """``overlap_weight * uncached prefill blocks + load blocks``: prefer the executor that
    holds the prefix unless it is busier than recomputing the prefix elsewhere. With an
    empty index (no overlap anywhere) this is load alone (SPEC section 5)."""

    name = "kv"

    def __init__(self, overlap_weight: float = DEFAULT_OVERLAP_WEIGHT) -> None:
        self.overlap_weight = check_overlap_weight(overlap_weight)

    def scores(self, candidates: Sequence[Candidate], *, dry_run: bool = False) -> list[float]:
        w = self.overlap_weight
        return [w * c.uncached_blocks + c.load_blocks for c in candidates]


class LeastLoadedPolicy:
    """Fewest load blocks, then fewest requests in flight; ignores the cache."""

    name = "least_loaded"

    def __init__(self, overlap_weight: float = DEFAULT_OVERLAP_WEIGHT) -> None:
        pass

    def scores(self, candidates: Sequence[Candidate], *, dry_run: bool = False) -> list[float]:
        return [c.load_blocks + c.in_flight * 1e-3 for c in candidates]


class RoundRobinPolicy:
    """Each call prefers the next executor in turn (among those offered); ignores cache
    and load. Holds only its turn counter, which a ``dry_run`` leaves alone."""

    name = "round_robin"

    def __init__(self, overlap_weight: float = DEFAULT_OVERLAP_WEIGHT) -> None:
        self._turn = 0

    def scores(self, candidates: Sequence[Candidate], *, dry_run: bool = False) -> list[float]:
        n = len(candidates)
        if n == 0:
            return []
        first = self._turn % n
        if not dry_run:
            self._turn += 1
        return [float((i - first) % n) for i in range(n)]


POLICIES: dict[str, type] = {p.name: p for p in (KVPolicy, RoundRobinPolicy, LeastLoadedPolicy)}


def make_policy(name: str, overlap_weight: float = DEFAULT_OVERLAP_WEIGHT) -> RoutingPolicy:
    """Build a policy by name; ``ValueError`` names ``--routing-policy`` when unknown and
    ``--overlap-weight`` when it is not a finite number >= 0 (whatever the policy)."""
    check_overlap_weight(overlap_weight)
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}: --routing-policy accepts {sorted(POLICIES)}") from None
    return cls(overlap_weight)


def choose(
    policy: RoutingPolicy, candidates: Sequence[Candidate], rng: random.Random, *, dry_run: bool = False
) -> Decision:
    """The lowest-scoring candidate, ties at random. Raises ``ValueError`` with none.
    ``dry_run`` changes neither the policy's state nor ``rng``'s: it returns the choice the
    same call without it would make now."""
    if not candidates:
        raise ValueError("no executor to route to")
    if dry_run:  # break ties with a copy: the next real decision draws what this one drew
        copy = random.Random()
        copy.setstate(rng.getstate())
        rng = copy
    scores = policy.scores(candidates, dry_run=dry_run)
    best = min(scores)
    tied = [c.name for c, s in zip(candidates, scores) if s == best]
    choice = tied[0] if len(tied) == 1 else rng.choice(tied)
    return Decision(choice, {c.name: s for c, s in zip(candidates, scores)})
