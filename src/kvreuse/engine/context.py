"""A sequence's read-only context: KV assembled in front of its own tokens (PML modules).

The engine holds one ``PromptContext`` per request that has such a context. Its KV lives in
pool blocks the request references but never writes; the new tokens attend to every key in
``slots`` (at RoPE ``positions``) and causally to each other. Under pool pressure a waiting
request lets its context go and acquires it again when its turn comes::

    HELD ──release()──▶ RELEASED ──acquire() (True)──▶ HELD
                           │ acquire() (False: the pool cannot hold it now) ─▶ RELEASED

Where the KV comes from (which blocks, recomputed how) is the ``ContextSource``'s business
(``pml.module_cache.ModuleCache.source(plan)``); the engine and the scheduler only ask the
handle. Engine thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvreuse.cache.kv_block import KVBlock
from kvreuse.document_prompt import Segment, SegmentKind  # noqa: F401 - value types, re-exported from here


class ContextState(enum.Enum):
    HELD = "held"  # one reference per block is held; slots and positions are valid
    RELEASED = "released"  # nothing held (not acquired yet, or let go while waiting); not admissible


class HeldKV(Protocol):
    """Acquired context KV: ``blocks`` each carry one reference the holder owns;
    ``slots[i]`` holds the key at RoPE position ``positions[i]`` (attention order)."""

    @property
    def blocks(self) -> Sequence[KVBlock]: ...
    @property
    def slots(self) -> Sequence[int]: ...
    @property
    def positions(self) -> Sequence[int]: ...


class ContextSource(Protocol):
    """Acquires and releases one context's KV (a PML module plan bound to its module cache)."""

    @property
    def num_blocks(self) -> int:
        """Blocks ``acquire`` holds (for the request's capacity check)."""
        ...

    @property
    def num_tokens(self) -> int:
        """Keys ``acquire`` gives (``len(slots)``), whatever is held now."""
        ...

    def acquire(self) -> HeldKV | None:
        """The KV, one reference per block for the caller (missing blocks are filled first);
        ``None`` when the pool cannot hold it now (nothing is held then)."""
        ...

    def release(self, held: HeldKV) -> None:
        """Drop the references ``acquire`` gave (blocks stay cached, evictable)."""
        ...


class _Holder(Protocol):
    """A request that may hold a context (``engine.sequence.Sequence``)."""

    context: PromptContext | None


class PromptContext:
    """The handle a ``Sequence`` keeps for its read-only context.

    ``slots``, ``positions`` and ``blocks`` are those of the current acquisition: fixed while
    ``HELD`` (a later acquisition, after a release, may bring other blocks: evicted ones are
    recomputed elsewhere) and empty while ``RELEASED``.
    """

    __slots__ = ("_source", "_held", "_num_tokens", "_arrays", "_shifts", "_num_recomputed", "_reused")

    def __init__(self, source: ContextSource, held: HeldKV | None = None) -> None:
        self._source = source
        self._held = held
        self._num_tokens = source.num_tokens  # asked once: it is read per output
        self._arrays: tuple[np.ndarray, np.ndarray] | None = None  # (slots, positions) of this acquisition
        self._shifts: np.ndarray | None = None  # [c] int64 of this acquisition (HeldKV.shifts), built once
        self._num_recomputed = getattr(held, "num_recomputed", 0)  # blend of the last acquisition
        # (reused keys, by tier) of the acquisition that found the fewest cached; None: not acquired yet
        self._reused: tuple[int, dict[str, int] | None] | None = None
        if held is not None:
            by_level = getattr(held, "reused_by_level", None)
            self._reused = (getattr(held, "num_reused", self._num_tokens), None if by_level is None else dict(by_level))

    @property
    def state(self) -> ContextState:
        return ContextState.RELEASED if self._held is None else ContextState.HELD

    @property
    def admissible(self) -> bool:
        """Whether the scheduler may admit the sequence (its context KV is held)."""
        return self._held is not None

    @property
    def slots(self) -> tuple[int, ...]:
        return () if self._held is None else tuple(self._held.slots)

    @property
    def positions(self) -> tuple[int, ...]:
        return () if self._held is None else tuple(self._held.positions)

    @property
    def blocks(self) -> tuple[KVBlock, ...]:
        return () if self._held is None else tuple(self._held.blocks)

    @property
    def segments(self) -> tuple[Segment, ...]:
        """The prompt's spans in request order (documents and text; ``Segment``), as the
        source laid them out; ``()`` for a source that has none (PML modules)."""
        return tuple(getattr(self._source, "segments", ()))

    @property
    def slot_array(self) -> np.ndarray:
        """``[c]`` int64 ``slots``, built once per acquisition (read every step)."""
        return self._array_pair()[0]

    @property
    def position_array(self) -> np.ndarray:
        """``[c]`` int64 ``positions``, built once per acquisition; the same object until the
        context is released or acquired again (callers may cache on its identity)."""
        return self._array_pair()[1]

    @property
    def shift_array(self) -> np.ndarray | None:
        """``[c]`` int64: how far each key's RoPE position is from the one its K was computed
        at (an acquisition whose ``HeldKV`` has ``shifts``: documents read in place);
        ``None`` when none moves, or while released."""
        shifts = None if self._held is None else getattr(self._held, "shifts", None)  # only documents have them
        if shifts is None:
            return None
        if self._shifts is None:
            self._shifts = np.asarray(shifts, dtype=np.int64).reshape(-1)  # [c]
        return self._shifts

    def _array_pair(self) -> tuple[np.ndarray, np.ndarray]:
        if self._arrays is None:
            held = self._held
            slots = np.asarray(() if held is None else held.slots, dtype=np.int64).reshape(-1)  # [c]
            positions = np.asarray(() if held is None else held.positions, dtype=np.int64).reshape(-1)  # [c]
            self._arrays = (slots, positions)
        return self._arrays

    @property
    def num_tokens(self) -> int:
        """Keys the context puts in front of the sequence's own tokens, in any state (they
        count as prompt tokens)."""
        return self._num_tokens

    @property
    def num_reused(self) -> int:
        """Of ``num_tokens``, the keys found cached rather than computed for this request (PML
        modules: all of them; documents: what their acquisitions found, the fewest of any, as a
        re-acquisition finds the request's own documents cached), counted as cached tokens."""
        return self._num_tokens if self._reused is None else self._reused[0]

    def reused_by_level(self, device_level: str) -> dict[str, int]:
        """``num_reused`` by the tier the keys were found in (``HeldKV.reused_by_level`` when
        the source says; otherwise all in the device pool, ``device_level``)."""
        by_level = None if self._reused is None else self._reused[1]
        return dict(by_level) if by_level is not None else {device_level: self.num_reused}

    @property
    def capacity_blocks(self) -> tuple[int, int]:
        """``(held, peak)``: blocks the context holds once acquired, and the most an acquisition
        holds at once (documents: their own blocks beside the copies), whatever the pool holds
        now, so whether a request can ever run does not depend on the load when it arrived."""
        peak = self._source.num_blocks
        return getattr(self._source, "held_blocks", peak), peak

    @property
    def num_blocks(self) -> int:
        """Distinct blocks the context takes in the pool (held or to acquire)."""
        if self._held is None:
            return self._source.num_blocks
        return len({b.block_id for b in self._held.blocks})

    def acquire(self) -> bool:
        """Hold the KV again (``HELD``); ``False`` (still ``RELEASED``, nothing held) when the
        pool cannot hold it now. A held context stays as it is."""
        if self._held is None:
            self._held = self._source.acquire()
            self._arrays = self._shifts = None
            if self._held is not None:
                self._num_recomputed = getattr(self._held, "num_recomputed", 0)
                # A later acquisition finds cached what an earlier one computed for this very
                # request: the request reused only what its first acquisition found.
                by_level = getattr(self._held, "reused_by_level", None)
                reused = getattr(self._held, "num_reused", self._num_tokens)
                if self._reused is None or reused < self._reused[0]:
                    self._reused = (reused, None if by_level is None else dict(by_level))
        return self._held is not None

    @property
    def num_recomputed_tokens(self) -> int:
        """Context tokens blend recomputed at the last acquisition (0: no blend);
        kept after the release, for the request's usage."""
        return self._num_recomputed

    def swap(self, held: HeldKV) -> None:
        """Hold ``held`` instead of the current acquisition (the same keys at the same
        positions: one moved copy of keys read in several RoPE frames), releasing the current
        one through the source. What the request reused and recomputed stays as counted.
        Raises ``RuntimeError`` while released."""
        if self._held is None:
            raise RuntimeError("context: swap while released (nothing held to replace)")
        old, self._held = self._held, held
        self._arrays = self._shifts = None
        self._source.release(old)

    def release(self) -> None:
        """Let the KV go (``RELEASED``): at the request's end, or while it waits under pool
        pressure. Releasing a released context does nothing."""
        held, self._held = self._held, None
        self._arrays = self._shifts = None
        if held is not None:
            self._source.release(held)


def reacquire_head(waiting: Sequence[_Holder]) -> None:
    """The first waiting request, if its context KV was let go, acquires it again
    (recomputing what was evicted meanwhile); if the pool cannot hold it yet it waits."""
    if waiting and waiting[0].context is not None:
        waiting[0].context.acquire()  # False: not now, running requests will free blocks


def release_behind_head(waiting: Sequence[_Holder]) -> bool:
    """Nothing runs and the first waiting request cannot be admitted: the context KV that
    requests behind it hold is in the way. They let it go (it stays cached, evictable) and
    acquire it again when their turn comes. Returns whether any did."""
    released = False
    for seq in list(waiting)[1:]:
        if seq.context is not None and seq.context.blocks:
            seq.context.release()
            released = True
    return released
