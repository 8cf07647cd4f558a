"""``RepairedSource``: a context source whose KV is seam-repaired for one request.

Wraps the ``ContextSource`` of an assembled context (PML modules, documents) and,
on every acquisition, repairs the seams between its segments before the request's own
tokens run::

    inner.acquire() ── shared segment blocks, one reference each
       │  runner.seam_deviation (only with a ratio: layers 0..1 into scratch, pool read-only)
       │  SeamRepair.select ── indices to recompute
       │  copy-on-write: each block holding a chosen token is copied into a fresh private
       │                 block (pool.allocate); the shared block stays held until release
       │  runner.recompute ── chosen tokens through every layer, by position, into the copies
       ▼
    RepairedKV(blocks, slots, positions, num_recomputed)

The shared blocks are never written (other requests read them), and stay held while the
copies are: a module's blocks form a chain the pool evicts tail first, so letting go of one
block in the middle of a held chain would count it free while it cannot be evicted. Private
copies carry no key, so releasing them frees them. A source whose blocks are already the
request's own (``private_blocks``: documents, copied to their request positions) is repaired
in place. An acquisition the pool cannot hold (the copies do
not fit) holds nothing and returns ``None``, like any ``ContextSource``. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvreuse.cache.kv_block import KVBlock
from kvreuse.engine.context import ContextSource, HeldKV
from kvreuse.engine.seam_repair import SeamRepair


class SegmentedSource(ContextSource, Protocol):
    """A context source that can say what its keys are: tokens and segment boundaries."""

    def assembled_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """``([num_tokens] int64 token ids of the keys in attention order, [s] int64 first
        key index of each segment, ascending)``."""
        ...

    @property
    def private_blocks(self) -> bool:
        """Whether ``acquire``'s blocks are the caller's alone (unregistered copies no other
        request reads): repair then writes them in place, with no copy-on-write."""
        ...


class RepairMechanics(Protocol):
    """What repair needs from the model runner (``ModelRunner`` has these methods)."""

    block_size: int

    def seam_deviation(self, token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                       layer: int = ...) -> np.ndarray: ...
    def recompute(self, token_ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
                  selected: np.ndarray) -> None: ...
    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None: ...


class BlockSource(Protocol):
    """Private blocks (``KVCacheManager``): ``pool.can_allocate``, ``allocate``, ``pool.release``."""

    pool: object

    def allocate(self, n: int) -> list[KVBlock]: ...


@dataclass(frozen=True)
class RepairedKV:
    """Held repaired context (an ``engine.context.HeldKV``): ``blocks`` each carry one
    reference the holder owns (every shared segment block, then the private copies; the
    slots point into the copies where there are some);
    ``num_recomputed`` tokens were recomputed for this acquisition."""

    blocks: tuple[KVBlock, ...]
    slots: tuple[int, ...]
    positions: tuple[int, ...]
    num_recomputed: int
    num_reused: int  # keys neither computed nor recomputed for this acquisition (cached_tokens)
    reused_by_level: dict[str, int] | None = None  # num_reused by tier (None: all in the device pool)


class RepairedSource:
    """``inner``'s context, seam-repaired by ``repair`` on each acquisition (see the module
    docstring). ``on_repair(n)`` is told each acquisition's recomputed count (metrics)."""

    def __init__(self, inner: SegmentedSource, repair: SeamRepair, runner: RepairMechanics, kv: BlockSource,
                 on_repair: Callable[[int], None] | None = None) -> None:
        self.inner = inner
        self.repair = repair
        self.runner = runner
        self.kv = kv
        self.on_repair = on_repair
        self._chosen: np.ndarray | None = None  # the selection, made at the first acquisition
        self._held_blocks: int | None = None

    @property
    def num_blocks(self) -> int:
        """The most an acquisition holds at once: the inner acquisition's peak (a PML module
        recomputed with its scratch), or what it keeps once it returned plus the private
        copies (``held_blocks``), made after it."""
        return max(self.inner.num_blocks, self.held_blocks)

    @property
    def held_blocks(self) -> int:
        """Blocks an acquisition keeps: the inner source's, plus at most one private copy per
        token the repair can choose (``first_tokens`` and ``last_tokens`` of each segment + the
        ratio's share; the selection itself is made at the first acquisition), and no copy of
        blocks that are already the caller's own."""
        if self._held_blocks is None:
            inner = getattr(self.inner, "held_blocks", self.inner.num_blocks)
            if self.inner.private_blocks:
                self._held_blocks = inner
            else:
                token_ids, starts = self.inner.assembled_tokens()
                n = len(token_ids)
                most = min(n, self.repair.most_by_position(len(starts), n) + self.repair.num_by_deviation(n))
                self._held_blocks = inner + min(inner, most)
        return self._held_blocks

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    @property
    def segments(self):
        """The inner source's segments (documents' layout; none for modules)."""
        return getattr(self.inner, "segments", ())

    def acquire(self) -> RepairedKV | None:
        held = self.inner.acquire()
        if held is None:
            return None
        try:
            repaired = self._repair(held)
        except BaseException:
            self.inner.release(held)
            raise
        if repaired is None:
            self.inner.release(held)
            return None
        if self.on_repair is not None:
            self.on_repair(repaired.num_recomputed)
        return repaired

    def release(self, held: HeldKV) -> None:
        self.kv.pool.release(reversed(tuple(held.blocks)))  # type: ignore[attr-defined]

    def _repair(self, held: HeldKV) -> RepairedKV | None:
        """The repaired KV holding what ``held`` held plus the private copies, or ``None``
        (nothing changed) when the copies do not fit in the pool now."""
        slots = np.asarray(held.slots, dtype=np.int64).reshape(-1)  # [n]
        positions = np.asarray(held.positions, dtype=np.int64).reshape(-1)  # [n]
        token_ids, starts = self.inner.assembled_tokens()
        if len(token_ids) != len(slots):
            raise RuntimeError(f"seam repair: {len(token_ids)} assembled tokens for {len(slots)} context keys")
        if self._chosen is None:
            # Chosen once: the context KV is the same at every acquisition (a module or document
            # recomputed after an eviction is recomputed alike), so a request that waits for
            # room and acquires again does not run the deviation pass again.
            deviation = None
            if self.repair.num_by_deviation(len(slots)):  # a ratio that picks no token needs no pass
                deviation = self.runner.seam_deviation(token_ids.tolist(), positions.tolist(), slots.tolist(),
                                                       layer=self.repair.deviation_layer)
            self._chosen = self.repair.select(starts, len(slots), deviation)  # [m]
        chosen = self._chosen
        blocks = tuple(held.blocks)
        taken = _cached_among(held, chosen)  # what the inner acquisition found cached and is recomputed now
        reused = getattr(held, "num_reused", len(slots)) - taken
        by_level = _less(getattr(held, "reused_by_level", None), taken)
        if not len(chosen):
            return RepairedKV(blocks, tuple(held.slots), tuple(held.positions), 0, reused, by_level)
        if self.inner.private_blocks:  # nobody else reads them: recompute in place
            self.runner.recompute(token_ids.tolist(), positions.tolist(), slots.tolist(), chosen)
            return RepairedKV(blocks, tuple(held.slots), tuple(held.positions), len(chosen), reused, by_level)
        bs = self.runner.block_size
        touched = np.unique(slots[chosen] // bs)  # [b] shared block ids holding a chosen token
        pool = self.kv.pool
        if not pool.can_allocate(len(touched)):  # type: ignore[attr-defined]
            return None
        copies = self.kv.allocate(len(touched))
        copy_ids = np.asarray([b.block_id for b in copies], dtype=np.int64)  # [b]
        self.runner.copy_blocks(touched.tolist(), copy_ids.tolist())
        block_of = slots // bs  # [n]
        where = np.searchsorted(touched, block_of)  # [n]
        hit = (where < len(touched)) & (touched[np.minimum(where, len(touched) - 1)] == block_of)  # [n]
        slots = np.where(hit, copy_ids[np.minimum(where, len(touched) - 1)] * bs + slots % bs, slots)  # [n]
        try:
            self.runner.recompute(token_ids.tolist(), positions.tolist(), slots.tolist(), chosen)
        except BaseException:
            pool.release(reversed(copies))  # type: ignore[attr-defined]
            raise
        return RepairedKV(blocks + tuple(copies), tuple(slots.tolist()), tuple(held.positions), len(chosen), reused,
                          by_level)


def _cached_among(held: HeldKV, chosen: np.ndarray) -> int:
    """How many of the ``chosen`` key indices the inner acquisition found cached: those in its
    ``reused_spans`` (``[start, stop)`` ranges; documents), or all of them for a source that
    has none (PML modules: every key counts as cached). A key the acquisition computed itself
    was never reused, so recomputing it takes nothing off the cached count."""
    spans = getattr(held, "reused_spans", None)
    if spans is None:
        return len(chosen)
    return sum(int(np.count_nonzero((chosen >= start) & (chosen < stop))) for start, stop in spans)


def _less(by_level: dict[str, int] | None, n: int) -> dict[str, int] | None:
    """``by_level`` with ``n`` fewer tokens in all, taken from its tiers in order (the
    recomputed keys are not told apart by tier), none below 0."""
    if by_level is None:
        return None
    out = {}
    for level, count in by_level.items():
        take = min(count, n)
        n -= take
        if count - take:
            out[level] = count - take
    return out
