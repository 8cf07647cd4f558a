"""The synchronous engine: requests in, one scheduling step at a time, outputs out.

Data flows one way: ``add_request`` -> scheduler -> cache manager -> model runner ->
output processor -> ``RequestOutput``, on one thread (the async wrapper's engine thread, or
the caller's for ``LLM``). Parts (built by ``engine_builder.build_engine``): ``cache``
(``CacheStack``: ``kv``, ``pool``, ``host``, ``stores``, ``events``, also kept here by name),
``intake`` (``PromptIntake``), ``outputs`` (``OutputProcessor``), ``schemas``
(``SchemaService``), ``scheduler``, ``runner``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from kvreuse.cache.retention import KvCacheRetentionConfig, checked_retention
from kvreuse.engine.blend import Blend, BlendOverride
from kvreuse.engine.config import EngineConfig  # re-exported: callers import it from here
from kvreuse.engine.context import reacquire_head, release_behind_head
from kvreuse.engine.document_cache import DocumentPrompt
from kvreuse.engine.engine_builder import build_engine
from kvreuse.engine.forward_isolation import isolate
from kvreuse.engine.introspection import check_engine_integrity, engine_stats
from kvreuse.engine.output_processor import OutputProcessor
from kvreuse.engine.outputs import EngineStats, RequestOutput  # re-exported: the engine's results
from kvreuse.engine.prompt_intake import AssembledPrompt, PromptIntake
from kvreuse.engine.request_checks import check_request
from kvreuse.engine.sampler import make_generator
from kvreuse.engine.schema_service import SchemaService
from kvreuse.engine.seq_chunk import SeqChunk, chunk_of
from kvreuse.engine.sequence import Sequence
from kvreuse.engine.spec_decode import SpecState, draft_for
from kvreuse.engine.step_faults import StepFaults
from kvreuse.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from kvreuse.cache.kv_cache_manager import RetentionFn
    from kvreuse.engine.scheduler import ScheduledChunk
    from kvreuse.events.buffer import EventBuffer
    from kvreuse.events.records import KVSnapshot
    from kvreuse.models.loader import LoadedModel
    from kvreuse.pml.prepared import PreparedPrompt
    from kvreuse.pml.registration import Settle

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "RequestOutput"]


class LLMEngine:
    """One executor. Not thread-safe: one thread calls ``add_request``/``step``/``abort``."""

    def __init__(
        self,
        config: EngineConfig,
        loaded: LoadedModel | None = None,
        *,
        events: EventBuffer | None = None,
        retention_fn: RetentionFn | None = None,
    ) -> None:
        parts = build_engine(config, loaded, events=events, retention_fn=retention_fn)
        self.config = config
        self.loaded = parts.loaded
        self.tokenizer = parts.loaded.tokenizer
        self.model_name: str = parts.loaded.name
        self.model_id: str = parts.loaded.model_id
        self.max_model_len: int = parts.max_model_len
        self.block_size = config.block_size
        self.eos_token_ids = frozenset(parts.loaded.eos_token_ids)
        self.kv_bytes_per_token = parts.kv_bytes_per_token
        self.cache = parts.cache
        self.kv, self.pool, self.host = parts.cache.kv, parts.cache.pool, parts.cache.host
        self.stores, self.events = parts.cache.stores, parts.cache.events
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.blend_pass = parts.blend_pass
        self.modules = parts.modules
        self.documents = parts.documents
        self.pacer = parts.pacer  # context passes yield to decodes; the engine loop attaches it
        self.registrations = parts.registrations
        self.schemas = SchemaService(parts.modules, parts.registrations)
        self.restored_schemas = parts.restored_schemas  # schemas persisted by an earlier run
        self.intake = PromptIntake(
            config,
            parts.modules,
            parts.documents,
            parts.runner,
            parts.blend_pass,
            self.kv,
            tokenizer=self.tokenizer,
            vocab_size=parts.loaded.shape.vocab_size,
            max_model_len=self.max_model_len,
        )
        self.faults = StepFaults.parse(config.debug_step_faults)  # test-only (engine/step_faults.py)
        self.outputs = OutputProcessor(
            self.tokenizer,
            self.eos_token_ids,
            self.kv,
            self._finish,
            by_tier=parts.cache.host is not None,
            faults=self.faults,
        )
        self._requests: dict[str, Sequence] = {}

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: list[int] | AssembledPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        retention: KvCacheRetentionConfig | None = None,
        prompt_positions: list[int] | None = None,
    ) -> None:
        """Queue a request: the one way in. ``prompt`` is plain token ids (at ``prompt_positions``;
        default ``0..n-1``) or what ``intake.assemble`` made of a PML or documents prompt (its
        own tokens at their positions, after its context, whose handle the request takes over
        and releases when it ends or is rejected here; a released handle is acquired when the
        request reaches the head of the queue; its TTFT starts at the intake). ``retention``: a
        ``KvCacheRetentionConfig`` or ``None`` (the JSON form is converted at the edge,
        ``as_retention``). Raises ``ValueError`` (naming the field) if it can never run."""
        context = prompt.context if isinstance(prompt, AssembledPrompt) else None
        token_ids = prompt.token_ids if isinstance(prompt, AssembledPrompt) else prompt
        if isinstance(prompt, AssembledPrompt):
            prompt_positions = prompt.positions
        try:
            check_request(
                request_id,
                token_ids,
                params,
                prompt_positions,
                in_use=self._requests,
                max_model_len=self.max_model_len,
                vocab_size=self.loaded.shape.vocab_size,
                pool_blocks=self.pool.num_blocks,
                blocks_needed=self.kv.blocks_needed,
                context_blocks=(0, 0) if context is None else context.capacity_blocks,
            )
            retention = checked_retention(retention)
            if cache_salt is not None and not isinstance(cache_salt, str):
                raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        except ValueError:
            if context is not None:
                context.release()
            raise
        seq = Sequence(
            request_id,
            list(token_ids),
            params,
            cache_salt=cache_salt,
            retention=retention,
            prompt_positions=prompt_positions,
            generator=make_generator(params.seed, self.runner.device),
            context=context,
        )
        if isinstance(prompt, AssembledPrompt):
            seq.arrival_time = prompt.arrival_time
        if self.config.speculative_tokens and params.greedy and params.speculative:
            seq.spec = SpecState()
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def prepare_prompt(self, pml_text: str) -> PreparedPrompt:
        """Compile a ``<prompt schema=...>`` over the registered schemas (``PromptIntake.prepare_pml``),
        once, at the edge; engine thread only. Raises ``PMLError``."""
        return self.intake.prepare_pml(pml_text)

    def add_prepared_request(
        self,
        request_id: str,
        prompt: PreparedPrompt | DocumentPrompt,
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        retention: KvCacheRetentionConfig | None = None,
        blend: BlendOverride | Blend | Mapping | None = None,
    ) -> None:
        """``add_request`` of ``intake.assemble(prompt)``: a PML prompt (``prepare_prompt``) or a
        ``DocumentPrompt``, blended as ``blend`` asks (``None`` or a knob left out: the
        server's ``--blend-*`` for PML modules, ``--document-blend-*`` for documents).
        Raises ``ValueError`` if the request can never run or ``blend`` is invalid (naming it)."""
        override = BlendOverride.of(blend)  # the edge for Python callers: a Mapping is parsed here, once
        retention = checked_retention(retention)  # before any work: documents take it as they fill
        assembled = self.intake.assemble(prompt, params, cache_salt=cache_salt, blend=override, retention=retention)
        self.add_request(request_id, assembled, params, cache_salt=cache_salt, retention=retention)

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq)

    def requests(self) -> Iterable[Sequence]:
        """The live requests' sequences (a view: do not change the engine while iterating)."""
        return self._requests.values()

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or schemas being registered (``step`` advances the
        requests, ``precompute_slice`` the registrations)."""
        return self.scheduler.has_work() or self.schemas.has_work()

    # ------------------------------------------------------------------ schemas
    def submit_schema(self, pml_text: str, settle: Settle, *, compiled: object = None) -> None:
        """Register a schema while serving: compiled and checked against the limits now
        (``compiled``: ``schemas.compile(pml_text)`` done already, off this thread), then
        precomputed a slice per ``precompute_slice`` call, between the requests' steps;
        ``settle(SchemaInfo, False)`` once it serves, ``settle(exc, True)`` if it fails.
        Raises ``PMLError`` (nothing queued) for bad markup or a schema over a limit."""
        self.schemas.submit(pml_text, settle, compiled=compiled)  # type: ignore[arg-type]  # a CompiledSchema or None

    def precompute_slice(self) -> None:
        """At most ``--schema-slice-tokens`` tokens of the registrations' module precompute
        (pml/registration.py); the engine loop calls it after every ``step``, once that
        step's outputs are delivered, so a token is never held back by a slice and a newly
        arrived request waits for one slice at most. Never raises. A pool too full for the
        next module makes that registration wait while requests run or wait (a waiting PML
        request holds its modules' KV, and runs once the registration holds nothing: both
        free blocks when they end); with none, it fails."""
        self.schemas.run_slice(can_wait=self.scheduler.has_work())

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Advance every running request by one scheduled chunk; returns one ``RequestOutput``
        per request that produced tokens this step (prefill chunks that end mid-prompt produce
        none), in plan order. Before scheduling: the stores' changes are applied, the first
        waiting request re-acquires a released context, finished document prompts get their
        moved copy, and speculating requests get drafts. When nothing can be admitted and
        nothing runs, contexts held by requests further back are let go once (deadlock
        breaking). Returns ``[]`` when nothing was scheduled.

        A failure one request causes costs only that request: a forward that raises is retried
        split until the failing chunks are found (``engine/forward_isolation.py``), and a
        request whose post-processing raises is dropped from the step (``OutputProcessor``);
        each such request ends with an output with ``finish_reason="error"`` and ``error`` set
        (listed first), its blocks freed, and the others' outputs are those of a step without
        it. An exception that no single request explains (every chunk's forward fails alone,
        scheduling, the stores, the pool) is raised and leaves the requests in the plan in an
        undefined state: the caller aborts them all (``AsyncEngine`` does). A context
        re-acquired here computes whole: the pacer never runs a step inside a step."""
        with self.pacer.paused():
            return self._step()

    def _step(self) -> list[RequestOutput]:
        self.cache.sync_stores()
        reacquire_head(self.scheduler.waiting)
        self.documents.move_framed(self.scheduler.running)
        if self.config.speculative_tokens:
            draft_for(
                self.scheduler.running,
                k_max=self.config.speculative_tokens,
                min_n=self.config.speculative_ngram_min,
                max_n=self.config.speculative_ngram_max,
            )
        plan = self.scheduler.schedule()
        waiting = self.scheduler.waiting
        if not plan and waiting and not self.scheduler.running and release_behind_head(waiting):
            plan = self.scheduler.schedule()
        if not plan:
            return []
        chunks = [chunk_of(item.seq, item.num_new_tokens, item.num_draft_tokens, self.block_size) for item in plan]
        ran = isolate(self._forward, plan, chunks)
        failed = [self.outputs.fail(item.seq, exc) for item, exc in ran.failed]
        if not ran.plan:
            return failed
        return failed + self.outputs.process(ran.plan, ran.chunks, ran.all_logits())

    def _forward(self, plan: list[ScheduledChunk], chunks: list[SeqChunk]) -> torch.Tensor:
        """``runner.execute(chunks)``: ``[num_rows, vocab]``, 1 row per sampling chunk, 1 + draft
        per verified draft. Commits nothing (a failed forward is retried split)."""
        logits = self.runner.execute(chunks)
        # test-only (engine/step_faults.py): raises when asked to
        self.faults.check_forward((item.seq.request_id, len(item.seq.output_token_ids)) for item in plan)
        return logits

    def _finish(self, seq: Sequence) -> None:
        """A request ended (the output processor saw its stop): free it."""
        self.scheduler.finish(seq)
        self._requests.pop(seq.request_id, None)

    # ------------------------------------------------------------------ introspection and the caches
    def stats(self) -> EngineStats:
        """Counters and gauges of this engine now (``engine/introspection.py``)."""
        return engine_stats(self)

    def check_integrity(self) -> None:
        """Pool, host tier and reference-count checks (``engine/introspection.py``); raises
        ``RuntimeError``. Call between steps."""
        check_engine_integrity(self)

    def kv_snapshot(self) -> KVSnapshot:
        """Every level's blocks as one ``KVSnapshot`` (``CacheStack.snapshot``). Engine thread
        only. Raises ``RuntimeError`` when events are off."""
        return self.cache.snapshot()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block not in use, on the device and in the host tier
        (``CacheStack.reset``); returns how many were dropped."""
        return self.cache.reset()

    def close(self) -> None:
        """Finish the disk / remote writes already queued and close the remote connections
        (``CacheStack.close``). Call when no step runs any more (a graceful stop)."""
        self.cache.close()
