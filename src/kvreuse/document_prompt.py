"""A prompt given as documents and text: the value types the edge builds and the engine lays out.

``DocumentPrompt`` (parts in request order, built by the API layer from a chat or a
completions request) and its ``layout()``: a ``DocumentLayout`` of context pieces, own tokens
and ``Segment`` spans. Values only, below every layer: ``api/`` builds them, ``engine/``
(``document_cache.py``, ``context.py``) reads them.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SegmentKind", "Segment", "DocumentLayout", "DocumentPrompt"]


class SegmentKind(enum.Enum):
    DOCUMENT = "document"  # a reusable document's KV at its request positions (read in place or moved copies)
    TEXT = "text"  # tokens computed by the request itself (its own tokens, not in the context)


@dataclass(frozen=True)
class Segment:
    """One span of a request's prompt, in request order: tokens ``start..start + length`` of
    the prompt as the user sent it, at RoPE positions ``position..position + length``. For a
    ``DOCUMENT``, ``context_start`` is the index of its first key in the context's ``slots`` /
    ``positions`` (what blend recomputes against the assembled context); ``None`` for
    ``TEXT`` (those are the sequence's own tokens)."""

    start: int
    length: int
    kind: SegmentKind
    position: int
    context_start: int | None = None


@dataclass(frozen=True)
class DocumentLayout:
    """Where a document prompt's tokens go. Everything up to the end of the last document is
    assembled context, in pieces: ``documents[i]`` (token ids) at ``document_positions[i]``,
    encoded after ``encoded_after[i]``. The text before the first document is a piece encoded
    after nothing (its true KV: the prefix every document is encoded after); a text part between
    documents is a piece encoded after that prefix, like a document. Only the text after the
    last document is computed by the request (``token_ids`` at ``positions``), so no token ever
    attends to one after it."""

    after: tuple[int, ...]  # the prompt's tokens before its first document (encoded with each)
    token_ids: tuple[int, ...]  # own tokens: the text after the last document
    positions: tuple[int, ...]  # [len(token_ids)] their RoPE positions
    documents: tuple[tuple[int, ...], ...]  # context pieces in request order (the head text first, if any)
    document_positions: tuple[int, ...]  # first position of each piece
    encoded_after: tuple[tuple[int, ...], ...]  # what each piece is encoded after
    segments: tuple[Segment, ...]

    @property
    def num_document_tokens(self) -> int:
        return sum(len(d) for d in self.documents)


@dataclass(frozen=True)
class DocumentPrompt:
    """A prompt given as parts, ``(token ids, is a document)`` in request order. The last part
    must be text (its logits start the reply); the text before the first document is what
    every document is encoded after."""

    parts: tuple[tuple[tuple[int, ...], bool], ...]

    @classmethod
    def of(cls, parts: Sequence[tuple[Sequence[int], bool]]) -> DocumentPrompt:
        """Raises ``ValueError`` naming ``documents`` when there is no document, a document is
        empty, or the prompt ends with a document."""
        frozen = tuple((tuple(int(t) for t in ids), bool(doc)) for ids, doc in parts if ids or doc)
        if not any(doc for _, doc in frozen):
            raise ValueError("documents: the prompt marks no document")
        if any(doc and not ids for ids, doc in frozen):
            raise ValueError("documents: a document is empty")
        if frozen[-1][1]:
            raise ValueError("documents: the prompt must end with text after its last document (a question)")
        return cls(frozen)

    def layout(self) -> DocumentLayout:
        first = next(i for i, (_, doc) in enumerate(self.parts) if doc)
        last = max(i for i, (_, doc) in enumerate(self.parts) if doc)
        after = tuple(t for ids, _ in self.parts[:first] for t in ids)
        pieces: list[tuple[int, ...]] = []  # context pieces, the head text first
        positions: list[int] = []  # first position of each piece
        encoded_after: list[tuple[int, ...]] = []  # what each piece is encoded after
        segments: list[Segment] = []
        pos = context = 0
        if after:
            pieces.append(after)
            positions.append(0)
            encoded_after.append(())
            segments.append(Segment(0, len(after), SegmentKind.TEXT, 0, 0))
            pos = context = len(after)
        for ids, doc in self.parts[first : last + 1]:
            pieces.append(ids)
            positions.append(pos)
            encoded_after.append(after)
            segments.append(Segment(pos, len(ids), SegmentKind.DOCUMENT if doc else SegmentKind.TEXT, pos, context))
            pos += len(ids)
            context += len(ids)
        own = tuple(t for ids, _ in self.parts[last + 1 :] for t in ids)
        segments.append(Segment(pos, len(own), SegmentKind.TEXT, pos))
        return DocumentLayout(
            after,
            own,
            tuple(range(pos, pos + len(own))),
            tuple(pieces),
            tuple(positions),
            tuple(encoded_after),
            tuple(segments),
        )

    @property
    def num_tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.parts)
