"""``BlendedSource``: a context source whose KV is blended for one request.

Wraps the ``ContextSource`` of an assembled context (PML modules, documents) and,
on every acquisition, blends the seams between its segments before the request's own
tokens run::

    inner.acquire() ── shared segment blocks, one reference each
       │  BlendPass.seam_deviation (only with a ratio: layers 0..1 into scratch, pool read-only)
       │  Blend.select ── indices to recompute
       │  private slots: the chosen tokens get fresh blocks of their own (pool.allocate),
       │                 packed; their keys point there (shift 0), every other key stays put
       │  BlendPass.recompute ── chosen tokens through every layer, by position, into those slots
       ▼
    BlendedKV(blocks, slots, positions, num_recomputed, shifts)

The shared blocks are never written (other requests read them) and stay held: a module's
blocks form a chain the pool evicts tail first, so letting go of one block in the middle of a
held chain would count it free while it cannot be evicted. The private blocks carry no key, so
releasing them frees them. Documents read in place (``shifts``: keys where they were computed)
are blended the same way, the recompute rotating its queries per document; a source whose
blocks are already the request's own (``private_blocks``: documents copied to their request
positions) is blended in place. An acquisition the pool cannot hold (the private blocks do
not fit) holds nothing and returns ``None``, like any ``ContextSource``. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from kvreuse.cache.kv_block import KVBlock, block_slots, cdiv
from kvreuse.engine.blend import Blend
from kvreuse.engine.context import ContextSource, HeldKV

if TYPE_CHECKING:
    from kvreuse.cache.block_pool import BlockPool


class SegmentedSource(ContextSource, Protocol):
    """A context source that can say what its keys are: tokens and segment boundaries."""

    def assembled_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """``([num_tokens] int64 token ids of the keys in attention order, [s] int64 first
        key index of each segment, ascending)``."""
        ...

    @property
    def private_blocks(self) -> bool:
        """Whether ``acquire``'s blocks are the caller's alone (unregistered copies no other
        request reads): blend then writes them in place, with no copy-on-write."""
        ...

    def release(self, held: Any) -> None:
        """``ContextSource.release`` of what this source's own ``acquire`` gave (each source
        takes its own ``HeldKV`` type back, hence ``Any`` here)."""
        ...


class BlendMechanics(Protocol):
    """What blend needs from the model (``engine.blend_pass.BlendPass``)."""

    @property
    def block_size(self) -> int: ...

    def seam_deviation(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        layer: int = ...,
        shifts: np.ndarray | None = ...,
    ) -> np.ndarray: ...
    def recompute(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        selected: np.ndarray,
        *,
        shifts: np.ndarray | None = ...,
    ) -> None: ...


class BlockSource(Protocol):
    """Private blocks (``KVCacheManager``): ``pool.can_allocate``, ``allocate``, ``pool.release``."""

    @property
    def pool(self) -> BlockPool: ...

    def allocate(self, n: int) -> list[KVBlock]: ...


@dataclass(frozen=True)
class BlendedKV:
    """Held blended context (an ``engine.context.HeldKV``): ``blocks`` each carry one
    reference the holder owns (every shared segment block, then the private blocks; the
    recomputed keys' slots point into those);
    ``num_recomputed`` tokens were recomputed for this acquisition."""

    blocks: tuple[KVBlock, ...]
    slots: tuple[int, ...]
    positions: tuple[int, ...]
    num_recomputed: int
    num_reused: int  # keys neither computed nor recomputed for this acquisition (cached_tokens)
    reused_by_level: dict[str, int] | None = None  # num_reused by tier (None: all in the device pool)
    shifts: np.ndarray | None = None  # [n] int64 keys read where computed (0: at their position); None: none moved


class BlendedSource:
    """``inner``'s context, blended by ``blend`` on each acquisition (see the module
    docstring). ``on_blend(n)`` is told each acquisition's recomputed count (metrics)."""

    def __init__(
        self,
        inner: SegmentedSource,
        blend: Blend,
        passes: BlendMechanics,
        kv: BlockSource,
        on_blend: Callable[[int], None] | None = None,
    ) -> None:
        self.inner = inner
        self.blend = blend
        self.passes = passes
        self.kv = kv
        self.on_blend = on_blend
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
        """Blocks an acquisition keeps: the inner source's, plus the private blocks of the most
        tokens the blend can choose, packed (``first_tokens`` and ``last_tokens`` of each
        segment + the ratio's share; the selection itself is made at the first acquisition),
        and none when the blocks are already the caller's own."""
        if self._held_blocks is None:
            inner = getattr(self.inner, "held_blocks", self.inner.num_blocks)
            if self.inner.private_blocks:
                self._held_blocks = inner
            else:
                token_ids, starts = self.inner.assembled_tokens()
                n = len(token_ids)
                most = min(n, self.blend.most_by_position(len(starts), n) + self.blend.num_by_deviation(n))
                self._held_blocks = inner + cdiv(most, self.passes.block_size)
        return self._held_blocks

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    @property
    def segments(self):
        """The inner source's segments (documents' layout; none for modules)."""
        return getattr(self.inner, "segments", ())

    def acquire(self) -> BlendedKV | None:
        held = self.inner.acquire()
        if held is None:
            return None
        try:
            blended = self._blend(held)
        except BaseException:
            self.inner.release(held)
            raise
        if blended is None:
            self.inner.release(held)
            return None
        if self.on_blend is not None:
            self.on_blend(blended.num_recomputed)
        return blended

    def release(self, held: HeldKV) -> None:
        self.kv.pool.release(reversed(tuple(held.blocks)))

    def _blend(self, held: HeldKV) -> BlendedKV | None:
        """The blended KV holding what ``held`` held plus the private blocks, or ``None``
        (nothing changed) when they do not fit in the pool now."""
        slots = np.asarray(held.slots, dtype=np.int64).reshape(-1)  # [n]
        positions = np.asarray(held.positions, dtype=np.int64).reshape(-1)  # [n]
        shifts = getattr(held, "shifts", None)
        shifts = None if shifts is None else np.asarray(shifts, dtype=np.int64).reshape(-1)  # [n]
        token_ids, starts = self.inner.assembled_tokens()
        if len(token_ids) != len(slots):
            raise RuntimeError(f"blend: {len(token_ids)} assembled tokens for {len(slots)} context keys")
        if self._chosen is None:
            # Chosen once: the context KV is the same at every acquisition (a module or document
            # recomputed after an eviction is recomputed alike), so a request that waits for
            # room and acquires again does not run the deviation pass again.
            deviation = None
            if self.blend.num_by_deviation(len(slots)):  # a ratio that picks no token needs no pass
                deviation = self.passes.seam_deviation(
                    token_ids.tolist(),
                    positions.tolist(),
                    slots.tolist(),
                    layer=self.blend.deviation_layer,
                    shifts=shifts,
                )
            self._chosen = self.blend.select(starts, len(slots), deviation)  # [m]
        chosen = self._chosen
        blocks = tuple(held.blocks)
        taken = _cached_among(held, chosen)  # what the inner acquisition found cached and is recomputed now
        reused = getattr(held, "num_reused", len(slots)) - taken
        by_level = _less(getattr(held, "reused_by_level", None), taken)
        if not len(chosen):
            return BlendedKV(blocks, tuple(held.slots), tuple(held.positions), 0, reused, by_level, shifts)
        if self.inner.private_blocks:  # nobody else reads them: recompute in place
            self.passes.recompute(token_ids.tolist(), positions.tolist(), slots.tolist(), chosen, shifts=shifts)
            return BlendedKV(blocks, tuple(held.slots), tuple(held.positions), len(chosen), reused, by_level, shifts)
        # The shared blocks are never written: the chosen tokens' new KV goes to private blocks
        # of their own, packed, and their keys point there (computed at their positions: shift 0).
        pool = self.kv.pool
        num_private = cdiv(len(chosen), self.passes.block_size)
        if not pool.can_allocate(num_private):
            return None
        private = self.kv.allocate(num_private)
        slots = slots.copy()
        slots[chosen] = block_slots([b.block_id for b in private], 0, len(chosen), self.passes.block_size)
        if shifts is not None:
            shifts = shifts.copy()
            shifts[chosen] = 0
            shifts = shifts if shifts.any() else None
        try:
            self.passes.recompute(token_ids.tolist(), positions.tolist(), slots.tolist(), chosen, shifts=shifts)
        except BaseException:
            pool.release(reversed(private))
            raise
        return BlendedKV(
            blocks + tuple(private), tuple(slots.tolist()), tuple(held.positions), len(chosen), reused, by_level, shifts
        )


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
