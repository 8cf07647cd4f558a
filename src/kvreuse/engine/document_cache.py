"""Schema-free document reuse: a document's KV computed once, then reused at the positions it takes
in each request, in any order and combination: read where it lies with the request's queries
rotated per document (``engine/key_frames.py``, no copy: a request that is not blended, on a
model without sliding windows), or copied with its keys moved (``engine/rope_shift.py``).

::

    DocumentPrompt(parts)             (token ids, is a document) in request order; the edge builds it
      .layout() ─▶ DocumentLayout     the text before the first document (``after``: what every document
                                      of the request is encoded after), the own tokens at their positions,
                                      the documents at theirs, the Segments
    DocumentCache.source(layout, salt) ─▶ DocumentSource  (an ``engine.context.ContextSource``)
      .acquire(): per document  fill ─ admit_blocks(keys): all cached ─▶ held
                                      │ else one causal pass ``after + document`` at 0.. (``after``
                                      │ in scratch blocks), fresh blocks registered (the pool's
                                      │ ordinary priority: tiers, eviction, events as for any block)
                  in place: the documents' blocks stay held, each key's shift recorded
                  ─▶ DocumentContext(blocks, slots, positions, shifts)
                  else one ``runner.copy_shifted`` of every document into fresh blocks of the
                  request's own (keys moved by request position - encoded position), documents released
                  ─▶ DocumentContext(blocks, slots, positions)  read-only context of the request

The context is everything up to the end of the last document: the text before the first
document (encoded after nothing, so its KV is exact and shared by every request starting with
it), the documents, and any text between them (encoded like a document); the request computes
only the text after the last document, which attends to the whole context. So no token attends
to a later one, and a document placed right after the text it was encoded after is exact.

A document's block chain is keyed like a prefix (``cache/hashing.py extend_chain``, partial
last block included) from a first block whose extra keys are ``("doc", model id[, "salt",
salt], sha256 of the after-text's ids)``: it never matches an ordinary prefix, a PML module,
another tenant's copy, or the same document encoded after other text. The request's copies are
never registered: they are its own, freed at its end. Read in place, the documents' blocks are
held like a PML module's (shared, never written, evictable again once released).

Engine thread only (it touches the pool and, through the runner, the KV tensor).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvreuse.cache.hashing import BlockHash, extend_chain, root_extra_keys
from kvreuse.cache.kv_block import KVBlock, block_slots, cdiv
from kvreuse.cache.kv_cache_manager import BlockRetention, KVCacheManager, asks_nothing, tokens_by_level
from kvreuse.cache.retention import KvCacheRetentionConfig, requested_block_retention
from kvreuse.document_prompt import DocumentLayout, DocumentPrompt, Segment  # noqa: F401 - values, re-exported from here
from kvreuse.engine.prefill_pacer import PrefillPacer
from kvreuse.events.records import HOST_LEVEL

if TYPE_CHECKING:
    from kvreuse.engine import sequence


class DocumentPoolBusy(ValueError):
    """The pool cannot hold the documents now (other requests hold the blocks)."""


@dataclass(frozen=True)
class DocumentContext:
    """A request's assembled context pieces (an ``engine.context.HeldKV``): ``blocks`` are its own
    (one reference each, unregistered); ``slots[i]`` holds the key at ``positions[i]``."""

    blocks: tuple[KVBlock, ...]
    slots: tuple[int, ...]
    positions: tuple[int, ...]
    num_reused: int  # document tokens found cached (the rest were computed by this acquisition)
    reused_by_level: dict[str, int]  # num_reused by the tier each was found in (GPU, CPU, DISK, REMOTE)
    # the num_reused keys as [start, stop) ranges of key indices: each piece's leading keys that were
    # found cached (what blend may take back, engine/blended_context.py)
    reused_spans: tuple[tuple[int, int], ...] = ()
    # read in place: [n] int64 request position - encoded position of each key (its K was not
    # moved; attention rotates the queries, engine/key_frames.py); None: copied, keys moved
    shifts: np.ndarray | None = None


class DocumentCache:
    """Document KV in ``kv``'s pool, computed and copied through ``runner`` (the model runner)."""

    def __init__(
        self,
        kv: KVCacheManager,
        runner,
        *,
        model_id: str,
        hash_algorithm: str = "sha256",
        chunk_tokens: int = 8192,
        pacer: PrefillPacer | None = None,
    ) -> None:
        """``pacer``: lets running decodes step between the chunks of a document's pass."""
        self.kv = kv
        self.pacer = pacer or PrefillPacer(None)
        self.pool = kv.pool
        self.runner = runner
        self.model_id = model_id
        self.hash_algorithm = hash_algorithm
        self.chunk_tokens = chunk_tokens
        self.tokens_computed = 0  # document tokens (and their after-text) run through the model
        self.tokens_reused = 0

    def keys(self, document: Sequence[int], after: Sequence[int], salt: str | None) -> list[BlockHash]:
        """Block keys of ``document`` encoded after ``after`` under ``salt`` (last block partial)."""
        digest = hashlib.sha256(struct.pack(f"<{len(after)}q", *after)).hexdigest()
        root = ("doc", *root_extra_keys(self.model_id, salt), digest)
        return extend_chain(
            [], document, self.pool.block_size, root_extra=root, algorithm=self.hash_algorithm, partial_tail=True
        )

    def source(
        self,
        layout: DocumentLayout,
        salt: str | None,
        *,
        in_place: bool = False,
        retention: KvCacheRetentionConfig | None = None,
    ) -> DocumentSource:
        """The request's ``ContextSource``; ``in_place``: reference the documents' own blocks
        (no copy; the keys stay where they were computed, so only for a request that is not
        blended, on a model without sliding-window layers), else copy them moved.
        ``retention``: the request's, over its prompt's token indices (a document block takes
        the range holding its first token at the document's position in the prompt)."""
        return DocumentSource(self, layout, salt, in_place, retention)

    # ------------------------------------------------------------------ one document
    def fill(
        self,
        document: Sequence[int],
        after: Sequence[int],
        salt: str | None,
        retention: BlockRetention = asks_nothing,
    ) -> tuple[list[KVBlock], dict[str, int]]:
        """The document's blocks, held (one reference each for the caller), computed where not
        cached, each with the retention ``retention(block index)`` asks (a request's
        ``cache_control`` over the document: hits and fresh blocks alike); returns them and
        its cached tokens by the tier they were found in. Raises ``DocumentPoolBusy`` (nothing
        held) when the pool cannot hold them now."""
        bs = self.pool.block_size
        keys = self.keys(document, after, salt)
        pieces = [tuple(document[i : i + bs]) for i in range(0, len(document), bs)]
        admission = self.kv.admit_blocks(keys, pieces, num_blocks=len(keys), retention=retention)
        if admission is None:
            raise DocumentPoolBusy(
                f"documents: the KV pool has {self.pool.num_free_blocks} free blocks, too few for "
                f"a document of {len(document)} tokens now: retry later or raise --kv-cache-memory"
            )
        blocks, hits = list(admission.blocks), admission.num_hits
        by_level = tokens_by_level(admission, bs, self.pool.cache_level)
        if hits == len(keys):
            if len(document) % bs:  # the last block (partial) holds fewer than block_size tokens
                # blocks come device hits, then onboarded (host), then loaded (stores): the last one's tier
                level = (
                    admission.loaded_levels[-1]
                    if admission.num_loaded
                    else HOST_LEVEL
                    if admission.num_onboarded
                    else self.pool.cache_level
                )
                by_level[level] -= hits * bs - len(document)
            return blocks, {k: v for k, v in by_level.items() if v}
        fresh = block_slots([b.block_id for b in blocks], hits * bs, len(document), bs)  # doc tokens to keep
        num_scratch = len(after) + hits * bs
        scratch = []
        try:
            if not self.pool.can_allocate(cdiv(num_scratch, bs)):
                raise DocumentPoolBusy(
                    "documents: the KV pool has no room to compute a document now: retry later "
                    "or raise --kv-cache-memory"
                )
            scratch = self.kv.allocate(cdiv(num_scratch, bs))
            slots = block_slots([b.block_id for b in scratch], 0, num_scratch, bs) + fresh
            tokens = list(after) + list(document)
            positions = list(range(len(tokens)))
            start = 0
            while start < len(tokens):  # decodes step between chunks (engine/prefill_pacer.py)
                end = start + self.pacer.chunk_tokens(self.chunk_tokens)
                self.runner.precompute_chunk(tokens, positions, slots, start, end)
                start = end
                if start < len(tokens):
                    self.pacer.between()
            self.tokens_computed += len(tokens)
            self.kv.register_blocks(blocks, keys, pieces, hits, len(keys), retention=retention)
        except BaseException:
            self.pool.release(reversed(blocks))
            raise
        finally:
            self.pool.release(reversed(scratch))
        return blocks, by_level

    def moved_copy(self, slots: np.ndarray, positions: np.ndarray, shifts: np.ndarray) -> DocumentContext | None:
        """One copy of a context read in place (``[c]`` int64 ``slots``, ``positions`` and
        ``shifts`` each) in fresh blocks of its own, keys rotated to their positions, one run:
        ``DocumentContext`` holding them (the caller swaps it in and lets the original go), or
        ``None`` when the pool cannot hold the copy now (nothing held then)."""
        moved = self.moved_blocks(slots, shifts)
        if moved is None:
            return None
        own, dst = moved
        return DocumentContext(tuple(own), tuple(dst.tolist()), tuple(np.asarray(positions).tolist()), 0, {})

    def move_framed(self, running: Iterable[sequence.Sequence]) -> None:
        """Each running request that has finished its prompt over documents read in place gets
        one moved copy of its context (``moved_copy``) and lets the documents' blocks go: its
        decode steps then read one run (a short context joins the batched decode) instead of
        one kernel call per document per layer. The prompt itself never waits for the copy (its
        first token comes from the keys in place). A pool that cannot hold the copy now leaves
        the context as it is (the engine tries again next step)."""
        for seq in running:
            context = seq.context
            if context is None or seq.is_prefill or context.shift_array is None:
                continue
            copy = self.moved_copy(context.slot_array, context.position_array, context.shift_array)
            if copy is not None:
                context.swap(copy)

    def moved_blocks(self, slots: np.ndarray, shifts: np.ndarray) -> tuple[list[KVBlock], np.ndarray] | None:
        """The keys in ``slots`` (``[c]`` int64) copied into fresh blocks, each moved by its
        ``shifts``: ``(the blocks, one reference each for the caller; [c] int64 their slots)``,
        or ``None`` when the pool cannot hold them now (nothing held then)."""
        bs, n = self.pool.block_size, len(slots)
        if not self.pool.can_allocate(cdiv(n, bs)):
            return None
        own = self.kv.allocate(cdiv(n, bs))
        dst = np.asarray(block_slots([b.block_id for b in own], 0, n, bs), dtype=np.int64)  # [c]
        try:
            self.runner.copy_shifted(slots, dst, shifts)
        except BaseException:
            self.pool.release(reversed(own))
            raise
        return own, dst


@dataclass(frozen=True)
class DocumentSource:
    """A document layout bound to its cache and salt: the ``engine.context.ContextSource`` of
    a document request."""

    cache: DocumentCache
    layout: DocumentLayout
    salt: str | None
    in_place: bool = False  # hold the documents' own blocks (shifts), instead of moved copies
    retention: KvCacheRetentionConfig | None = None  # the request's, over prompt token indices

    def block_retention(self, piece: int) -> BlockRetention:
        """The retention the request asks for block ``j`` of context piece ``piece``: the range
        holding the block's first token, counted where the piece sits in the prompt."""
        config = self.retention
        if config is None:
            return asks_nothing
        first, bs = self.layout.document_positions[piece], self.cache.pool.block_size
        end = first + len(self.layout.documents[piece])  # no document token is a generated one
        return lambda j: requested_block_retention(config, first + j * bs, num_prompt_tokens=end)

    @property
    def private_blocks(self) -> bool:
        """Copies are the request's own (blend writes them in place); in place, they are shared."""
        return not self.in_place

    @property
    def segments(self) -> tuple[Segment, ...]:
        return self.layout.segments

    def assembled_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """``([num_tokens] int64 token ids of the context keys in request order, [s] int64 first
        key index of each piece)`` (``engine.blended_context.SegmentedSource``): blend's
        ``first_tokens`` apply to every document and text piece."""
        pieces = self.layout.documents
        tokens = np.asarray([t for ids in pieces for t in ids], dtype=np.int64)  # [n]
        lengths = np.asarray([len(ids) for ids in pieces], dtype=np.int64)  # [pieces]
        return tokens, (np.cumsum(lengths) - lengths)

    @property
    def num_tokens(self) -> int:
        return self.layout.num_document_tokens

    @property
    def held_blocks(self) -> int:
        """Blocks an acquisition keeps: the request's copies, or (in place) the documents' own."""
        bs = self.cache.pool.block_size
        if self.in_place:
            return sum(cdiv(len(d), bs) for d in self.layout.documents)
        return cdiv(self.num_tokens, bs)

    @property
    def num_blocks(self) -> int:
        """The most an acquisition holds at once: the documents' own blocks, plus the request's
        copies (held beside them while copying) unless in place, or (in place) the largest
        scratch a document's fill holds beside them: the text it is encoded after and the
        cached blocks it recomputes (all but its last, partly cached at worst)."""
        bs = self.cache.pool.block_size
        layout = self.layout
        own = sum(cdiv(len(d), bs) for d in layout.documents)
        if not self.in_place:
            return own + cdiv(self.num_tokens, bs)
        scratch = max(
            (
                cdiv(len(after) + (cdiv(len(doc), bs) - 1) * bs, bs)
                for doc, after in zip(layout.documents, layout.encoded_after)
            ),
            default=0,
        )
        return own + scratch

    def acquire(self) -> DocumentContext | None:
        """Every document filled, then copied to fresh blocks at its request positions (in
        place: its own blocks kept, each key's shift recorded); ``None`` when the pool cannot
        hold them now (nothing held then)."""
        cache, layout = self.cache, self.layout
        held: list[list[KVBlock]] = []
        try:
            by_level: dict[str, int] = {}
            spans: list[tuple[int, int]] = []
            start = 0
            for piece, (doc, after) in enumerate(zip(layout.documents, layout.encoded_after)):
                blocks, cached = cache.fill(doc, after, self.salt, self.block_retention(piece))
                held.append(blocks)
                for level, count in cached.items():
                    by_level[level] = by_level.get(level, 0) + count
                spans.append((start, start + sum(cached.values())))  # cached blocks lead a document's chain
                start += len(doc)
            reused = sum(by_level.values())
            if self.in_place:
                context, held = self._in_place(held, reused, by_level, tuple(spans)), []  # the context holds them now
                return context
            src, positions, shifts = self._placement(held)  # every piece copied to its request positions
            moved = cache.moved_blocks(src, shifts)
            if moved is None:
                return None
            own, dst = moved
            cache.tokens_reused += reused
            return DocumentContext(
                tuple(own), tuple(dst.tolist()), tuple(positions.tolist()), reused, by_level, tuple(spans)
            )
        except DocumentPoolBusy:
            return None
        finally:
            for blocks in reversed(held):
                cache.pool.release(reversed(blocks))

    def _in_place(
        self, held: list[list[KVBlock]], reused: int, by_level: dict[str, int], spans: tuple[tuple[int, int], ...]
    ) -> DocumentContext:
        """The documents' own blocks as the context: keys where they were computed, each with
        its shift (request position - encoded position)."""
        slots, positions, shifts = self._placement(held)
        self.cache.tokens_reused += reused
        blocks = tuple(b for chain in held for b in chain)
        return DocumentContext(
            blocks,
            tuple(slots.tolist()),
            tuple(positions.tolist()),
            reused,
            by_level,
            spans,
            shifts if shifts.any() else None,
        )

    def _placement(self, held: list[list[KVBlock]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``([n] slots the pieces' keys lie in, [n] their request positions, [n] request
        position - encoded position)``, int64, in request order."""
        layout, bs = self.layout, self.cache.pool.block_size
        src = np.concatenate(
            [
                np.asarray(block_slots([b.block_id for b in blocks], 0, len(doc), bs), np.int64)
                for blocks, doc in zip(held, layout.documents)
            ]
        )  # [n]
        positions = np.concatenate(
            [np.arange(p, p + len(doc), dtype=np.int64) for p, doc in zip(layout.document_positions, layout.documents)]
        )  # [n]
        encoded = np.concatenate(
            [
                np.arange(len(after), len(after) + len(doc), dtype=np.int64)
                for doc, after in zip(layout.documents, layout.encoded_after)
            ]
        )  # [n] where computed
        return src, positions, positions - encoded

    def release(self, held: DocumentContext) -> None:
        self.cache.pool.release(reversed(held.blocks))
