"""Prompt intake: a PML prompt or a documents prompt becomes one ``AssembledPrompt``.

::

    PreparedPrompt (PML, prepare_pml) ──ModuleCache.source(plan)───┐
                                                                   ├─ BlendedSource (when the blend
    DocumentPrompt ──check_documents──DocumentCache.source(layout)─┘   recomputes anything)
                                                                   ▼
               PromptContext(source).acquire() ─▶ AssembledPrompt ─▶ LLMEngine.add_request

A plain prompt (token ids) needs no intake: ``add_request`` takes its ids as they are. The
assembled context's KV is acquired here (recomputing evicted modules, copying or placing
documents, blending the seams) or, when the pool cannot hold it now, when the request
reaches the head of the queue; its time counts toward the request's TTFT. Engine thread only
(``context_blocks`` excepted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvreuse.engine.blend import Blend, BlendOverride
from kvreuse.engine.blended_context import BlendedSource, SegmentedSource
from kvreuse.engine.context import ContextSource, PromptContext
from kvreuse.engine.document_cache import DocumentPrompt
from kvreuse.engine.request_checks import check_documents
from kvreuse.pml.prepared import PreparedPrompt, prepare_prompt

if TYPE_CHECKING:
    from kvreuse.cache.kv_cache_manager import KVCacheManager
    from kvreuse.cache.retention import KvCacheRetentionConfig
    from kvreuse.engine.blend_pass import BlendPass
    from kvreuse.engine.config import EngineConfig
    from kvreuse.engine.document_cache import DocumentCache, DocumentLayout
    from kvreuse.engine.model_runner import ModelRunner
    from kvreuse.pml.module_cache import ModuleCache
    from kvreuse.sampling_params import SamplingParams


@dataclass(frozen=True)
class AssembledPrompt:
    """A prompt whose own tokens run after KV assembled in front of them (PML modules or
    documents): what ``add_request`` takes instead of plain token ids."""

    token_ids: list[int]  # the request's own tokens
    positions: list[int]  # their RoPE positions (the context's keys hold the others)
    context: PromptContext  # the assembled KV; the request owns the handle from add_request on
    arrival_time: float  # time.perf_counter() when intake began: the TTFT includes assembly and blend


class PromptIntake:
    """Turns prompts with reusable KV into ``AssembledPrompt``s, blending their seams as asked
    (``BlendOverride`` over ``--blend-*`` for PML modules, ``--document-blend-*`` for
    documents). ``blend_tokens`` counts the assembled tokens blend recomputed, every
    acquisition included."""

    def __init__(
        self,
        config: EngineConfig,
        modules: ModuleCache,
        documents: DocumentCache,
        runner: ModelRunner,
        blend_pass: BlendPass,
        kv: KVCacheManager,
        *,
        tokenizer: object,
        vocab_size: int,
        max_model_len: int,
    ) -> None:
        self.modules = modules
        self.tokenizer = tokenizer
        self.documents = documents
        self.runner = runner
        self.blend_pass = blend_pass
        self.kv = kv
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.module_blend: Blend = config.blend
        self.document_blend: Blend = config.document_blend
        self.blend_tokens = 0

    def prepare_pml(self, pml_text: str) -> PreparedPrompt:
        """Compile a ``<prompt schema=...>`` over the registered schemas. Raises ``PMLError``.

        Engine thread only: ``register``/``remove`` mutate the schema dict on this thread, so
        compiling here, in one call, reads one consistent version of it. The result is frozen
        and may cross threads; its plan keeps the schema version it was compiled against, so a
        schema replaced or removed before the request is queued still serves it."""
        return prepare_prompt(pml_text, self.modules.schemas, self.tokenizer)

    def assemble(
        self,
        prompt: PreparedPrompt | DocumentPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        blend: BlendOverride | None = None,
        retention: KvCacheRetentionConfig | None = None,
    ) -> AssembledPrompt:
        """The ``AssembledPrompt`` of a PML prompt (its new tokens at their positions, after the
        KV of the modules it selects) or of a documents prompt (its text parts, each
        document's KV computed once per model, salt, token ids and the text before the first
        document, placed in front of them at its positions). ``blend``: the request's, over
        this kind's default; blend recomputes into private copies of the blocks it changes
        (``engine/blended_context.py``). Raises ``ValueError`` naming the field for a documents
        prompt that can never run (nothing acquired)."""
        arrival = time.perf_counter()  # the TTFT includes the context's acquisition and blend
        if isinstance(prompt, DocumentPrompt):
            layout = prompt.layout()
            check_documents(
                layout.documents,
                prompt.num_tokens,
                params.max_tokens,  # before any of it runs
                vocab_size=self.vocab_size,
                max_model_len=self.max_model_len,
            )
            self.runner.rope_shift()  # a rope type whose keys cannot be moved is a ValueError now, before any work
            context = PromptContext(self._document_source(layout, cache_salt, blend, retention), None)
            token_ids, positions = list(layout.token_ids), list(layout.positions)
        else:
            source = self._blended(self.modules.source(prompt.plan), blend, self.module_blend)
            context = PromptContext(source, None)
            token_ids, positions = prompt.token_ids, list(prompt.position_ids)  # own copy: the prompt is shared
        context.acquire()
        return AssembledPrompt(token_ids, positions, context, arrival)

    def context_blocks(self, prompt: DocumentPrompt, blend: BlendOverride | None = None) -> int:
        """Blocks the context of ``prompt`` holds once acquired (the documents' blocks, blend's
        private ones), as the request's capacity check counts them: what a route leaves out of
        the pool when it sizes a default ``max_tokens``. Pure (any thread): nothing is acquired."""
        source = self._document_source(prompt.layout(), None, blend)
        return getattr(source, "held_blocks", source.num_blocks)

    def _document_source(
        self,
        layout: DocumentLayout,
        cache_salt: str | None,
        blend: BlendOverride | None,
        retention: KvCacheRetentionConfig | None = None,
    ) -> ContextSource:
        """The context source of a documents request: read where computed (no copy; queries
        rotated per document, blend's recomputed tokens in private blocks), or moved copies on
        a model with sliding windows (a window masks keys by position in one frame); the
        documents' blocks take ``retention`` (the request's ``cache_control``). Pure."""
        in_place = not self.runner.layout.sliding_windows
        source = self.documents.source(layout, cache_salt, in_place=in_place, retention=retention)
        return self._blended(source, blend, self.document_blend)

    def _blended(self, source: SegmentedSource, blend: BlendOverride | None, default: Blend) -> ContextSource:
        """``source`` blended as ``blend`` asks over ``default`` (``None``: ``default``), or
        ``source`` itself when that recomputes nothing."""
        chosen = default if blend is None else blend.over(default)
        if not chosen.enabled:
            return source
        return BlendedSource(source, chosen, self.blend_pass, self.kv, on_blend=self._count_blend)

    def _count_blend(self, num_tokens: int) -> None:
        self.blend_tokens += num_tokens
