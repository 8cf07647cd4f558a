"""Decode keeps going while a prompt's context KV is computed outside the scheduler.

A documents prompt's new documents and a PML prompt's evicted modules are computed when the
prompt is assembled (``PromptIntake.assemble`` -> ``context.acquire``), before the request
reaches the scheduler, so ``--max-prefill-tokens-while-decoding`` cannot bound them: an
8,192-token document was one forward, and every running stream waited for it. The pacer
gives those passes the scheduler's rule::

    DocumentCache.fill / ModuleFill.run                     EngineLoop (attach)
      for each chunk:  n = pacer.chunk_tokens(default) ──▶ the cap while a request decodes
                       runner.precompute_chunk(n tokens)
                       pacer.between() ──────────────────▶ one engine step (decodes + capped prefill)

Without ``attach`` (the synchronous ``LLM``: requests are added before any step) the pacer
changes nothing. Only a pass run while a request is added paces: inside any engine step
(``LLMEngine.step`` holds ``paused``; the step ``between`` runs is one), a context acquired
there (the waiting head's, re-acquired) runs its chunks whole, as before, so a step never runs
inside a step. Engine thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvreuse.engine.scheduler import prefill_cap


class PrefillPacer:
    """Chunk sizes and steps between the chunks of a context pass (module docstring)."""

    def __init__(self, cap: int | None, per_decode: int = 0) -> None:
        """``cap``: the scheduler's ``max_prefill_tokens_while_decoding`` (``None``: no cap,
        the pacer never steps); ``per_decode``: its ``prefill_tokens_per_decode`` (a chunk
        grows to that many tokens per decoding request when that is more, as a step's cap does)."""
        self.cap = cap
        self.per_decode = per_decode
        self._step: Callable[[], None] | None = None
        self._decoding: Callable[[], int] = lambda: 0
        self._inside = False
        self.steps_between = 0  # engine steps run between context chunks (tests, stats)

    def attach(self, step: Callable[[], None], decoding: Callable[[], int]) -> None:
        """Let ``between`` run ``step`` (one engine step, its outputs delivered; must not
        raise) whenever ``decoding()`` (how many running requests decode; a bool counts as
        0 / 1) says a running request is decoding."""
        self._step, self._decoding = step, decoding

    @property
    def active(self) -> bool:
        """Whether a context pass now yields to decodes (attached, capped, a decode running,
        not already inside a step the pacer ran)."""
        return self._step is not None and self.cap is not None and not self._inside and bool(self._decoding())

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No pacing while inside (an engine step: a step must never run inside a step, or a
        context acquired in both would be acquired twice and its first hold leak)."""
        saved, self._inside = self._inside, True
        try:
            yield
        finally:
            self._inside = saved

    def chunk_tokens(self, default: int) -> int:
        """Tokens the next chunk of a context pass runs: the cap (grown by ``per_decode`` per
        decoding request, as the scheduler's) while ``active``, else ``default``."""
        cap = prefill_cap(self.cap, self.per_decode, int(self._decoding()))
        return default if not self.active or cap is None else min(default, cap)

    def between(self) -> None:
        """Between two chunks of a context pass: one engine step if ``active``. The pass's
        blocks are held by their caller, so the step cannot evict them."""
        if not self.active or self._step is None:
            return
        with self.paused():
            self._step()
            self.steps_between += 1
