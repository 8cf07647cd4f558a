"""A failed forward, retried split until the chunks that fail it are found.

``isolate(forward, plan, chunks)`` runs one step's forward; if it raises, the plan is halved
and each half retried, recursively, down to single chunks: the chunks that still fail alone
are the step's failures (their requests end with the error), every other chunk's logits come
from a forward that succeeded. Retrying is idempotent: a forward writes each new token's K/V
to that token's slot and reads only keys committed before the step (its own and shared
prefix blocks), so a chunk re-run after a failed forward writes the same values to the same
slots; nothing is committed (``num_computed_tokens``, prefix-cache blocks) before a forward
succeeded (``OutputProcessor`` commits afterwards). A failed chunk's slots hold whatever the
failed forward left: its request is freed without committing them.

A failure that every chunk of a plan of several shows alone is nobody's: the first error is
raised (the caller fails every request). Costs nothing when the forward succeeds; a failing
chunk among ``n`` costs about ``2 log2 n`` extra forwards of shrinking batches.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvreuse.engine.model_runner import SeqChunk
    from kvreuse.engine.scheduler import ScheduledChunk

logger = logging.getLogger(__name__)

Forward = Callable[[list["ScheduledChunk"], list["SeqChunk"]], torch.Tensor]
"""``forward(plan, chunks)``: ``[rows, vocab]`` fp32 logits of the sampling chunks, in order."""


@dataclass
class IsolatedForward:
    """The chunks whose forward succeeded (in plan order) with their logits, and the failed ones."""

    plan: list[ScheduledChunk] = field(default_factory=list)
    chunks: list[SeqChunk] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # per successful forward: [rows, vocab]
    failed: list[tuple[ScheduledChunk, Exception]] = field(default_factory=list)

    def all_logits(self) -> torch.Tensor:
        """``[rows, vocab]``: the rows of ``chunks`` in their order."""
        return self.logits[0] if len(self.logits) == 1 else torch.cat(self.logits)


def isolate(forward: Forward, plan: list[ScheduledChunk], chunks: list[SeqChunk]) -> IsolatedForward:
    """Run ``forward`` over the plan; on failure, split it until the failing chunks are alone.
    Raises the first error when every chunk of a plan of two or more fails alone."""
    result = IsolatedForward()
    try:
        result.logits.append(forward(plan, chunks))
    except Exception as first:  # split below; raised again if nobody's
        if len(plan) == 1:
            result.failed.append((plan[0], first))
            return result
        logger.warning(
            "forward of %d chunks failed (%s); retrying split to find the failing request(s)", len(plan), first
        )
        _bisect(forward, plan, chunks, result)
        if not result.plan:
            raise first
        return result
    result.plan, result.chunks = list(plan), list(chunks)
    return result


def _bisect(forward: Forward, plan: list[ScheduledChunk], chunks: list[SeqChunk], into: IsolatedForward) -> None:
    """Retry the two halves of a failed ``plan`` (recursively), appending to ``into`` in order."""
    mid = len(plan) // 2
    for part, part_chunks in ((plan[:mid], chunks[:mid]), (plan[mid:], chunks[mid:])):
        try:
            logits = forward(part, part_chunks)
        except Exception as exc:  # noqa: BLE001 - the failing chunks are found by splitting
            if len(part) == 1:
                into.failed.append((part[0], exc))
            else:
                _bisect(forward, part, part_chunks, into)
            continue
        into.plan += part
        into.chunks += part_chunks
        into.logits.append(logits)
