"""The synchronous engine: requests in, one scheduling step at a time, outputs out.

Data flows one way: ``add_request`` -> scheduler -> cache manager -> model runner ->
sampler -> ``RequestOutput``. Everything here runs on one thread (the async wrapper's
engine thread, or the caller's thread for ``LLM``).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from kvreuse.engine.allocator import keep_freed_memory
from kvreuse.cache.block_pool import BlockPool
from kvreuse.cache.eviction import make_policy
from kvreuse.events.buffer import EventBuffer
from kvreuse.cache.host_tier import HostTier
from kvreuse.engine.kv_transfer import HostKVTransfer
from kvreuse.tiers.setup import build_host_tier
from kvreuse.cache.kv_cache_manager import KVCacheManager, RetentionFn, request_retention
from kvreuse.engine.logprobs import TokenLogprobs, requested_logprobs
from kvreuse.engine.attention import KeyTable
from kvreuse.engine.model_runner import KVLayout, ModelRunner, SeqChunk
from kvreuse.engine.config import EngineConfig  # re-exported: callers import it from here
from kvreuse.engine.outputs import EngineStats, RequestOutput  # re-exported: the engine's results
from kvreuse.engine.context import PromptContext
from kvreuse.engine.document_cache import DocumentCache, DocumentPrompt
from kvreuse.engine.repaired_context import RepairedSource
from kvreuse.engine.seam_repair import SeamRepair
from kvreuse.engine.introspection import check_engine_integrity, engine_stats
from kvreuse.pml.module_cache import ModuleCache
from kvreuse.pml.prepared import PreparedPrompt, prepare_prompt
from kvreuse.pml.registration import RegistrationQueue, Settle
from kvreuse.pml.schema_cost import SchemaLimits
from kvreuse.cache.retention import KvCacheRetentionConfig, checked_retention
from kvreuse.engine.sampler import greedy_tokens, make_generator, sample_one
from kvreuse.engine.request_checks import check_documents, check_request
from kvreuse.engine.sampling_params import SamplingParams
from kvreuse.engine.scheduler import Scheduler
from kvreuse.pml.schema_store import SchemaStore
from kvreuse.engine.sequence import Sequence
from kvreuse.engine.spec_decode import SpecState, accepted_length, propose
from kvreuse.engine.stop_checker import check_stop

if TYPE_CHECKING:
    from kvreuse.events.records import KVSnapshot
    from kvreuse.tiers.persistent import PersistentTiers

log = logging.getLogger(__name__)


class LLMEngine:
    """One executor. Not thread-safe: one thread calls ``add_request``/``step``/``abort``."""

    def __init__(self, config: EngineConfig, loaded=None, *, events=None, retention_fn: RetentionFn | None = None):
        from kvreuse.models.loader import load_model  # heavy import kept off the router's path

        self.config = config
        if loaded is None:
            loaded = load_model(config.model, dtype=config.dtype, device=config.device,
                                quantization=config.quantization)
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name: str = loaded.name
        self.model_id: str = loaded.model_id
        self.max_model_len: int = config.max_model_len or loaded.shape.max_model_len
        self.block_size = config.block_size
        self.eos_token_ids = frozenset(loaded.eos_token_ids)
        shape = loaded.shape
        layout = KVLayout(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            sliding_windows=tuple(sorted({w for w in shape.sliding_window if w is not None})),
        )
        self.kv_bytes_per_token = layout.bytes_per_token(loaded.dtype)
        bytes_per_block = self.kv_bytes_per_token * config.block_size
        num_blocks = int(config.kv_cache_memory_gib * 2**30) // bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"--kv-cache-memory {config.kv_cache_memory_gib} GiB holds no block of {bytes_per_block} bytes"
            )
        if events is None and config.event_buffer_max_size > 0:
            events = EventBuffer(config.event_buffer_max_size)
        self.events: EventBuffer | None = events  # None = events off (TensorRT-LLM's default)
        self.host: HostTier | None = build_host_tier(config, layout, loaded, events, bytes_per_block)
        self.stores: "PersistentTiers | None" = None if self.host is None else self.host.below  # type: ignore[assignment]
        self.pool = BlockPool(
            num_blocks, config.block_size, policy=make_policy(config.eviction_policy, num_blocks=num_blocks), events=events,
            record_evictions=self.host is not None,
        )
        self.kv = KVCacheManager(
            self.pool,
            lower=self.host,
            model_id=self.model_id,
            hash_algorithm=config.hash_algorithm,
            enable_prefix_caching=config.enable_prefix_caching,
            retention_fn=retention_fn or request_retention,
        )
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens
        )
        self.runner = ModelRunner(loaded.model, layout, num_blocks, config.block_size)
        if self.host is not None:  # its bytes move through the runner's KV tensor
            self.host.mover = HostKVTransfer(self.runner.kv_cache, self.host.pool.num_blocks, config.block_size)
        if self.runner.device.type == "cpu":
            keep_freed_memory()  # no page faults on activations after a long prefill
        gc.freeze()  # the model's objects never die: keep them out of every later GC pass (as vLLM does)
        self.modules = ModuleCache(  # PML schemas: module KV precomputed into the pool
            self.kv, self.runner, self.tokenizer, model_id=self.model_id, hash_algorithm=config.hash_algorithm,
            chunk_tokens=min(config.schema_slice_tokens, config.max_num_batched_tokens),
            store=None if config.schema_dir is None else SchemaStore(config.schema_dir, self.model_id),
            src_dir=config.schema_src_dir, max_model_len=self.max_model_len,
            limits=SchemaLimits(config.schema_max_tokens, config.schema_max_bytes),
            kv_bytes_per_token=self.kv_bytes_per_token,
        )
        # Schema-free documents: KV computed once, copied and moved to each request's positions.
        self.documents = DocumentCache(self.kv, self.runner, model_id=self.model_id, hash_algorithm=config.hash_algorithm,
                                       chunk_tokens=config.max_num_batched_tokens)
        # Schemas registered while serving: a slice of their precompute after each step (submit_schema).
        self.registrations = RegistrationQueue(config.schema_slice_tokens)
        self.restored_schemas = self.modules.load_store()  # schemas persisted by an earlier run
        self._requests: dict[str, Sequence] = {}
        self.tokens_computed = 0
        self.seam_repair_tokens = 0  # assembled tokens recomputed by seam repair
        self.spec_draft_tokens = 0  # prompt lookup: drafted tokens verified (all requests)
        self.spec_accepted_tokens = 0  # of those, accepted
        torch.manual_seed(config.seed)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        cache_salt: str | None = None,
        retention: KvCacheRetentionConfig | None = None,
        prompt_positions: list[int] | None = None,
        context: PromptContext | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ``ValueError`` (naming the field) if it can never run.
        ``arrival_time`` (``time.perf_counter``; default now): where its TTFT starts, set by
        callers that did work for it first (a context's acquisition, seam repair).

        ``retention``: a ``KvCacheRetentionConfig`` or ``None`` (the JSON form is converted at
        the edge, ``as_retention``; anything else is a ``ValueError``).

        ``context``: read-only KV assembled in front of the prompt (``add_prepared_request``);
        the request takes the handle over and releases it when it ends or is rejected here.
        A released handle is acquired when the request reaches the head of the queue.
        """
        try:
            check_request(request_id, prompt_token_ids, params, prompt_positions, in_use=self._requests,
                          max_model_len=self.max_model_len, vocab_size=self.loaded.shape.vocab_size,
                          pool_blocks=self.pool.num_blocks, blocks_needed=self.kv.blocks_needed,
                          context_blocks=(0, 0) if context is None else context.capacity_blocks)
            retention = checked_retention(retention)
            if cache_salt is not None and not isinstance(cache_salt, str):
                raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        except ValueError:
            if context is not None:
                context.release()
            raise
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params,
            cache_salt=cache_salt,
            retention=retention,
            prompt_positions=prompt_positions,
            generator=make_generator(params.seed, self.runner.device),
            context=context,
        )
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        if self.config.speculative_tokens and params.greedy and params.speculative:
            seq.spec = SpecState()
        self._requests[request_id] = seq
        self.scheduler.add(seq)

    def prepare_prompt(self, pml_text: str) -> PreparedPrompt:
        """Compile a ``<prompt schema=...>`` over the registered schemas, once, at the edge
        (``LLM.generate``; the server through ``AsyncEngine.call``). Raises ``PMLError``.

        Engine thread only: ``register``/``remove`` mutate the schema dict on this thread, so
        compiling here, in one call, reads one consistent version of it (no snapshot to keep
        in step). The result is frozen and may cross threads; its plan keeps the schema
        version it was compiled against, so a schema replaced or removed before the request
        is queued still serves it (as it does a request already queued)."""
        return prepare_prompt(pml_text, self.modules.schemas, self.tokenizer)

    def add_prepared_request(
        self, request_id: str, prompt: PreparedPrompt, params: SamplingParams, *, cache_salt: str | None = None,
        retention=None, blend: "SeamRepair | Mapping | None" = None,
    ) -> None:
        """Queue a PML prompt (``prepare_prompt``): its new tokens at their positions, after the
        KV of the modules it selects. That KV is acquired now (recomputing evicted modules) or,
        when the pool cannot hold it now, when the request reaches the head of the queue.
        ``blend``: the seam repair of the assembled modules (``SeamRepair`` or its JSON form;
        ``None``: the server's ``--blend-*``), done at each acquisition into private copies
        of the blocks it changes (engine/repaired_context.py). A ``DocumentPrompt`` goes to
        ``add_document_request``.
        Raises ``ValueError`` if the request can never run or ``blend`` is invalid (naming it)."""
        if isinstance(prompt, DocumentPrompt):
            return self.add_document_request(request_id, prompt, params, cache_salt=cache_salt, retention=retention,
                                             blend=blend)
        arrival = time.perf_counter()  # the TTFT includes the modules' acquisition and repair
        source = self._repaired(self.modules.source(prompt.plan), blend, self.config.blend)
        context = PromptContext(source, None)
        context.acquire()
        self.add_request(request_id, prompt.token_ids, params, cache_salt=cache_salt, retention=retention,
                         prompt_positions=list(prompt.position_ids), context=context,  # own copy: shared prompt
                         arrival_time=arrival)

    def _repaired(self, source, blend, default: SeamRepair):
        """``source`` seam-repaired as ``blend`` asks (``SeamRepair.from_json``; ``None`` or an
        omitted field: ``default``, the server's ``--blend-*`` for PML modules, its
        ``--document-blend-*`` for documents), or ``source`` itself when that repairs nothing."""
        repair = SeamRepair.from_json(blend, default)
        if not repair.enabled:
            return source
        return RepairedSource(source, repair, self.runner, self.kv, on_repair=self._count_repair)

    def _count_repair(self, num_tokens: int) -> None:
        self.seam_repair_tokens += num_tokens
        self.tokens_computed += num_tokens

    def add_document_request(
        self, request_id: str, prompt: DocumentPrompt, params: SamplingParams, *, cache_salt: str | None = None,
        retention=None, blend: "SeamRepair | Mapping | None" = None,
    ) -> None:
        """Queue a prompt with reusable documents (``DocumentPrompt``): its text parts are the
        request's own tokens, each document's KV (computed once per model, salt, token ids and
        the text before the first document) is copied in front of them at its positions, then
        seam-repaired as ``blend`` asks (as ``add_prepared_request``; the copies are the
        request's own, so repair writes them in place). The KV is acquired now or, when the
        pool cannot hold it, at the head of the queue. Raises ``ValueError`` naming the field
        if the request can never run or ``blend`` is invalid."""
        arrival = time.perf_counter()  # the TTFT includes the documents' copy and repair
        layout = prompt.layout()
        check_documents(layout.documents, prompt.num_tokens, params.max_tokens,  # before any of it runs
                        vocab_size=self.loaded.shape.vocab_size, max_model_len=self.max_model_len)
        self.runner.rope_shift()  # a rope type whose keys cannot be moved is a ValueError now, before any work
        source = self._document_source(layout, cache_salt, blend)
        context = PromptContext(source, None)
        context.acquire()
        self.add_request(request_id, list(layout.token_ids), params, cache_salt=cache_salt, retention=retention,
                         prompt_positions=list(layout.positions), context=context, arrival_time=arrival)

    def _document_source(self, layout, cache_salt: str | None, blend):
        """The context source of a documents request: read where computed (no copy; queries
        rotated per document, repair's recomputed tokens in private blocks), or moved copies on
        a model with sliding windows (a window masks keys by position in one frame). Pure."""
        in_place = not self.runner.layout.sliding_windows
        return self._repaired(self.documents.source(layout, cache_salt, in_place=in_place), blend,
                              self.config.document_blend)

    def document_context_blocks(self, prompt: DocumentPrompt, blend: "SeamRepair | Mapping | None" = None) -> int:
        """Blocks the context of ``add_document_request(prompt, blend=blend)`` holds once
        acquired (the documents' blocks, repair's private ones), as the request's capacity
        check counts them: what a route leaves out of the pool when it sizes a default
        ``max_tokens``. Pure (any thread): nothing is acquired. Raises ``ValueError`` for an
        invalid ``blend``."""
        source = self._document_source(prompt.layout(), None, blend)
        return getattr(source, "held_blocks", source.num_blocks)

    def _restore_context(self) -> None:
        """The first waiting request, if its context KV was let go, acquires it again
        (recomputing what was evicted meanwhile); if the pool cannot hold it yet it waits."""
        waiting = self.scheduler.waiting
        if waiting and waiting[0].context is not None:
            waiting[0].context.acquire()  # False: not now, running requests will free blocks

    def _break_context_deadlock(self) -> bool:
        """Nothing runs and the first waiting request cannot be admitted: the context KV
        that requests behind it hold is in the way. They let it go (it stays cached,
        evictable) and acquire it again when their turn comes. Returns whether any did."""
        released = False
        for seq in list(self.scheduler.waiting)[1:]:
            if seq.context is not None and seq.context.blocks:
                seq.context.release()
                released = True
        return released

    def abort_request(self, request_id: str) -> None:
        """Stop a request and free its blocks; unknown or finished ids are ignored."""
        seq = self._requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.finish(seq)

    def requests(self):
        """The live requests' sequences (a view: do not change the engine while iterating)."""
        return self._requests.values()

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or schemas being registered (``step`` advances the
        requests, ``precompute_slice`` the registrations)."""
        return self.scheduler.has_work() or self.registrations.has_work()

    def submit_schema(self, pml_text: str, settle: Settle, *, compiled=None) -> None:
        """Register a schema while serving: compiled and checked against the limits now
        (``compiled``: ``modules.compile(pml_text)`` done already, off this thread), then
        precomputed a slice per ``precompute_slice`` call, between the requests' steps;
        ``settle(SchemaInfo, False)`` once it serves, ``settle(exc, True)`` if it fails.
        Raises ``PMLError`` (nothing queued) for bad markup or a schema over a limit."""
        schema = self.modules.compile(pml_text) if compiled is None else compiled
        self.registrations.submit(self.modules.start(schema, pml_text, settle=settle))

    def precompute_slice(self) -> None:
        """At most ``--schema-slice-tokens`` tokens of the registrations' module precompute
        (pml/registration.py); the engine loop calls it after every ``step``, once that
        step's outputs are delivered, so a token is never held back by a slice and a newly
        arrived request waits for one slice at most. Never raises. A pool too full for the
        next module makes that registration wait while requests run or wait (a waiting PML
        request holds its modules' KV, and runs once the registration holds nothing: both
        free blocks when they end); with none, it fails."""
        if self.registrations.has_work():
            self.registrations.run_slice(can_wait=self.scheduler.has_work())

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        self.sync_stores()
        self._restore_context()
        self._move_framed_contexts()
        self._draft()
        plan = self.scheduler.schedule()
        if not plan and self.scheduler.waiting and not self.scheduler.running and self._break_context_deadlock():
            plan = self.scheduler.schedule()
        if not plan:
            return []
        chunks = [self._chunk(item.seq, item.num_new_tokens, item.num_draft_tokens) for item in plan]
        logits = self.runner.execute(chunks)  # [num_rows, vocab]: 1 per sampling chunk, 1 + draft per verified draft
        # per sampling chunk: (item, first logits row, tokens to append in order)
        sampled: list[tuple[object, int, list[int]]] = []
        row = 0
        now = time.perf_counter()
        for item, chunk in zip(plan, chunks):
            seq = item.seq
            self.tokens_computed += item.num_new_tokens
            if item.num_draft_tokens:  # committed once the kept tokens are known (_settle_draft)
                targets = greedy_tokens(logits[row : row + chunk.num_logits])  # [1 + draft]
                a = accepted_length(seq.draft_token_ids, targets)
                sampled.append((item, row, seq.draft_token_ids[:a] + [targets[a]]))
                row += chunk.num_logits
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit_computed(seq)
            if chunk.sample:
                sampled.append((item, row, [sample_one(logits[row], seq.params, seq.generator)]))
                row += 1
        new_logprobs = requested_logprobs(logits, [(it.seq, r + j, t) for it, r, tokens in sampled
                                               for j, t in enumerate(tokens)])
        outputs: list[RequestOutput] = []
        for item, first_row, tokens in sampled:
            seq = item.seq
            if seq.first_token_time is None:
                seq.first_token_time = now
            new_text, reason, kept_lps = "", None, []
            for j, token in enumerate(tokens):
                seq.output_token_ids.append(token)
                lp = new_logprobs.get((seq.request_id, first_row + j))
                if lp is not None:
                    seq.output_logprobs.append(lp)
                    kept_lps.append(lp)
                piece, reason = check_stop(seq, self.tokenizer, self.eos_token_ids)
                new_text += piece
                if reason is not None:
                    break  # tokens accepted past a stop or max_tokens are never emitted
            kept = tokens[: j + 1]
            if item.num_draft_tokens:
                self._settle_draft(seq, item.num_draft_tokens, len(tokens) - 1, len(kept))
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                self._requests.pop(seq.request_id, None)
            outputs.append(self._output(seq, kept, new_text, kept_lps if seq.params.logprobs is not None else None))
        for item in plan:
            item.seq.draft_token_ids.clear()
        return outputs

    def _move_framed_contexts(self) -> None:
        """A request that has finished its prompt over documents read in place gets one moved
        copy of its context (keys rotated to their positions, in one run of its own blocks)
        and lets the documents' blocks go: its decode steps then read one run (a short context
        joins the batched decode) instead of one kernel call per document per layer. The prompt
        itself never waits for the copy (its first token comes from the keys in place). A pool
        that cannot hold the copy now leaves the context as it is (tried again next step)."""
        for seq in self.scheduler.running:
            context = seq.context
            if context is None or seq.is_prefill or context.shift_array is None:
                continue
            copy = self.documents.moved_copy(context.slot_array, context.position_array, context.shift_array)
            if copy is not None:
                context.swap(copy)

    def _draft(self) -> None:
        """Prompt lookup: give each greedy decoding request that speculates a draft
        (``spec_decode.propose``) of at most ``speculative_tokens`` tokens, never past its
        ``max_tokens`` (the model's own next token always follows the accepted ones)."""
        k_max = self.config.speculative_tokens
        if not k_max:
            return
        for seq in self.scheduler.running:
            spec = seq.spec
            seq.draft_token_ids = []  # a draft lives one step: never verify a stale one
            if spec is None or seq.num_computed_tokens != seq.num_tokens - 1 or not spec.ready():
                continue
            k = min(k_max, seq.params.max_tokens - len(seq.output_token_ids) - 1)
            if k < 1:
                continue
            tokens = spec.tokens(seq.token_ids_between, seq.num_tokens)
            seq.draft_token_ids = propose(tokens, min_n=self.config.speculative_ngram_min,
                                          max_n=self.config.speculative_ngram_max, k=k)

    def _settle_draft(self, seq: Sequence, drafted: int, accepted: int, kept: int) -> None:
        """After a verified draft: ``kept`` of the ``accepted + 1`` tokens were appended
        (fewer when a stop or max_tokens cut them). KV is valid for the last token before
        the step and every kept accepted draft token; full blocks of those become
        cacheable, and the blocks holding only rejected drafts go back to the pool."""
        seq.num_computed_tokens = seq.num_tokens - kept + min(kept, accepted)
        self.kv.commit_computed(seq)
        self.kv.trim(seq)
        seq.spec.record(drafted, accepted)  # type: ignore[union-attr]
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted

    def _chunk(self, seq: Sequence, n: int, num_draft: int = 0) -> SeqChunk:
        """The runner's view of ``seq``'s next ``n`` tokens (the last ``num_draft`` of them its
        draft, all with logits): its block table and context arrays as they are (no per-token
        work over the tokens computed before)."""
        c = seq.num_computed_tokens
        token_ids = seq.token_ids_between(c, c + n - num_draft)
        if num_draft:
            token_ids = token_ids + seq.draft_token_ids
        return SeqChunk(
            token_ids=token_ids,
            positions=seq.positions_between(c, c + n).tolist(),
            keys=KeyTable(seq.context_slots, seq.block_table, self.block_size, c + n, seq.context_shifts),
            context_positions=seq.key_positions(c),  # None unless explicit positions (PML) or module context
            sample=c + n - num_draft == seq.num_tokens,
            num_logits=1 + num_draft,
        )

    def _output(self, seq: Sequence, new_ids: list[int], new_text: str,
                new_logprobs: list[TokenLogprobs] | None) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=list(seq.output_token_ids),
            new_token_ids=new_ids,
            text=seq.text,
            new_text=new_text,
            finished=seq.finish_reason is not None,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens + seq.num_context_tokens,  # PML modules are prompt too
            num_cached_tokens=seq.num_cached_tokens,
            cached_tokens_by_tier=None if self.host is None else dict(seq.cached_tokens_by_tier),
            num_recomputed_tokens=0 if seq.context is None else seq.context.num_recomputed_tokens,
            ttft_s=None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time,
            logprobs=None if seq.params.logprobs is None else list(seq.output_logprobs),
            new_logprobs=new_logprobs,
            num_draft_tokens=0 if seq.spec is None else seq.spec.num_draft_tokens,
            num_accepted_tokens=0 if seq.spec is None else seq.spec.num_accepted_tokens,
        )

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        """Counters and gauges of this engine now (``engine/introspection.py``)."""
        return engine_stats(self)

    def check_integrity(self) -> None:
        """Pool, host tier and reference-count checks (``engine/introspection.py``); raises
        ``RuntimeError``. Call between steps."""
        check_engine_integrity(self)

    def close(self) -> None:
        """Finish the disk / remote writes already queued (at most 5 s: what is left is a
        recompute later) and close the remote connections, so a restarted executor finds
        what this one computed. Call when no step runs any more (a graceful stop)."""
        if self.stores is not None:
            self.stores.close()

    def cache_pools(self) -> tuple:
        """The device pool, then the tiers below it: the host pool and the stores' ledgers
        (snapshots list every level)."""
        if self.host is None:
            return (self.pool,)
        return (self.pool, self.host.pool, *self.host.ledgers.values())

    def sync_stores(self) -> int:
        """Apply what the disk / remote stores reported since the last call (finished writes,
        removals) to their ledgers, emitting their events. Engine thread; ``step`` calls it
        first, an idle ``AsyncEngine`` when ``watch_stores``' wake-up fires. Returns how many
        changes there were."""
        return 0 if self.host is None else self.host.sync_stores()

    def watch_stores(self, wake: Callable[[], None]) -> None:
        """Have the stores call ``wake()`` (thread-safe, non-blocking) from their threads
        whenever they report a change, so an idle engine thread applies it."""
        if self.stores is not None:
            self.stores.on_change = wake

    @property
    def remote_store_id(self) -> str | None:
        """Identity of the remote store this executor shares (no credentials), or None."""
        return None if self.stores is None else self.stores.remote_store_id

    def kv_snapshot(self) -> "KVSnapshot":
        """Every level's blocks (``cache_pools``) as one ``KVSnapshot`` labelled with the id of
        the last event they reflect, store changes applied first. Engine thread only.
        Raises ``RuntimeError`` when events are off."""
        if self.events is None:
            raise RuntimeError("KV events are off (--event-buffer-max-size 0): no snapshot to take")
        self.sync_stores()
        return self.events.snapshot(self.cache_pools())

    def reset_prefix_cache(self) -> int:
        """Forget every cached block not in use, on the device and in the host tier; returns
        how many were dropped. The disk and remote stores keep theirs: after the device's
        ``AllBlocksCleared`` (which consumers apply to every level) their ledgers announce
        them again."""
        dropped = 0
        if self.host is not None:  # first, so the device's AllBlocksCleared (if any) is the last word
            dropped += self.host.pool.evict_all_cached()
        dropped += self.pool.evict_all_cached()
        if self.host is not None and not self.pool.cached_hashes():  # the device said AllBlocksCleared
            for ledger in self.host.ledgers.values():
                ledger.announce_all()
        return dropped
