"""The offline Python API, in vLLM's shape::

from kvreuse import LLM, SamplingParams
llm = LLM(model="default")
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
outs[0].text, outs[0].token_ids, outs[0].num_cached_tokens, outs[0].ttft_s
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence as Seq
from typing import Any, cast

from kvreuse.cache.retention import KvCacheRetentionConfig, as_retention
from kvreuse.engine.blend import Blend, BlendOverride
from kvreuse.engine.document_cache import DocumentPrompt
from kvreuse.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from kvreuse.events.records import event_to_json
from kvreuse.pml.module_cache import SchemaInfo
from kvreuse.pml.prepared import is_pml_prompt
from kvreuse.sampling_params import SamplingParams

# vLLM's prompt forms: text, token ids, or its TextPrompt / TokensPrompt dicts
PromptType = str | list[int] | DocumentPrompt | Mapping[str, Any]


def _plain_prompt(prompt: object) -> str | list[int] | DocumentPrompt:
    """``prompt`` as text, token ids or a ``DocumentPrompt``; a ``{"prompt": text}`` or
    ``{"prompt_token_ids": ids}`` dict (vLLM's ``TextPrompt`` / ``TokensPrompt``) unwrapped.
    Raises TypeError naming the accepted forms for anything else (a dict with other keys, ids
    that are not ints)."""
    if isinstance(prompt, Mapping):
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if set(prompt) == {"prompt_token_ids"} and isinstance(prompt["prompt_token_ids"], (list, tuple)):
            prompt = prompt["prompt_token_ids"]  # ids only: a str here is not taken as text
        else:
            raise TypeError(
                "prompt: a dict must be {'prompt': str} or {'prompt_token_ids': list[int]}, "
                f"got keys {sorted(prompt)}"
            )
    if isinstance(prompt, (str, DocumentPrompt)):
        return prompt
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise TypeError(
        "prompt: text, a list of token ids (int), a DocumentPrompt, {'prompt': str} or "
        f"{{'prompt_token_ids': list[int]}}; got {type(prompt).__name__}"
    )


class LLM:
    """Runs requests to completion on the caller's thread.

    ``loaded`` takes an already loaded model (tests pass tiny random-weight ones); any
    other keyword is an ``EngineConfig`` field (``kv_cache_memory_gib``, ``block_size``...).
    """

    def __init__(self, model: str = "default", *, loaded=None, events=None, **config) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config), loaded=loaded, events=events)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        cache_salt: str | None = None,
        retention: KvCacheRetentionConfig | Mapping[str, Any] | None = None,
        blend: Blend | Mapping[str, Any] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}`` dicts), batched; results in prompt order.
        A ``DocumentPrompt`` reuses its documents' KV at any position (``engine/document_cache.py``).
        Text starting with ``<prompt`` is a PML prompt over a registered schema (``register_schema``).
        ``sampling_params`` is one for all prompts or one per prompt (as in vLLM).
        ``retention`` applies to every prompt: a ``KvCacheRetentionConfig`` or its JSON form
        (a mapping, converted here once). ``blend`` is the blend of the assembled PML modules or
        documents (``Blend(first_tokens, ratio)`` or ``{"first_tokens": k, "ratio": r}``, parsed here once;
        ``None`` or a field left out: the engine's ``document_blend_*`` for documents (on by
        default), ``blend_*`` for PML modules (off by default)); each output's
        ``num_recomputed_tokens`` says how many it recomputed.
        Raises ``ValueError`` for a prompt that can never run (too long, empty, bad PML), a
        retention that is neither (naming ``kv_cache_retention_config``) or a list of sampling
        params whose length differs from the prompts'; ``TypeError`` for a prompt of another form."""
        if isinstance(prompts, (str, DocumentPrompt, Mapping)) or (prompts and isinstance(prompts[0], int)):
            prompts = [cast("PromptType", prompts)]  # one prompt (a token-id list is one, too)
        prompts = [_plain_prompt(p) for p in cast("Seq[PromptType]", prompts)]  # a sequence of prompts by now
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts; "
                    "give one, or one per prompt"
                )
            per_prompt = list(sampling_params)
        else:
            per_prompt = [sampling_params or SamplingParams()] * len(prompts)
        config = as_retention(retention)  # the engine takes the typed config
        override: BlendOverride | None = None  # blend, parsed once at the first prompt that has seams
        ids: list[str] = []
        for prompt, params in zip(prompts, per_prompt):
            rid = f"llm-{next(self._ids)}"
            try:
                if isinstance(prompt, DocumentPrompt) or (isinstance(prompt, str) and is_pml_prompt(prompt)):
                    # documents (KV reused at any position) or PML over a registered schema (docs/pml.md),
                    # compiled once, here (the engine thread)
                    prepared = prompt if isinstance(prompt, DocumentPrompt) else self.engine.prepare_prompt(prompt)
                    override = override or BlendOverride.of(blend)  # ValueError naming the field
                    assembled = self.engine.intake.assemble(prepared, params, cache_salt=cache_salt, blend=override)
                    self.engine.add_request(rid, assembled, params, cache_salt=cache_salt, retention=config)
                else:
                    token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                    self.engine.add_request(rid, token_ids, params, cache_salt=cache_salt, retention=config)
            except ValueError:
                for queued in ids:
                    self.engine.abort_request(queued)
                raise
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def register_schema(self, pml_text: str, *, src_dir=None, use_tqdm: bool = False) -> SchemaInfo:
        """Compile a ``<schema>`` and precompute every module's KV into the pool (priority 90),
        or load it from ``schema_dir``. Prompts ``<prompt schema="name">`` then reuse it.
        Raises ``PMLError`` (a ``ValueError``) naming line/column or the module."""
        if not use_tqdm:
            return self.engine.modules.register(pml_text, src_dir=src_dir)
        from tqdm import tqdm

        with tqdm(desc="precomputing modules", unit="module") as bar:

            def progress(done: int, total: int, name: str) -> None:
                bar.total = total
                bar.set_postfix_str(name or "<root>")
                bar.update(done - bar.n)

            return self.engine.modules.register(pml_text, src_dir=src_dir, progress=progress)

    def remove_schema(self, name: str) -> bool:
        """Forget a registered schema (its blocks fall to the default priority and its file in
        ``schema_dir`` is deleted), as ``DELETE /v1/schemas/{name}``; ``False`` if unknown."""
        return self.engine.schemas.remove(name)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        **kwargs,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt) and generate. A message
        with ``"kvreuse": {"document": True}`` is a reusable document (as over HTTP)."""
        # one conversation (a list of messages) or a list of them
        conversations = cast("list[list[dict]]", [messages] if messages and isinstance(messages[0], dict) else messages)
        prompts = [self._chat_prompt(conv) for conv in conversations]
        return self.generate(prompts, sampling_params, **kwargs)

    def _chat_prompt(self, messages: list[dict]) -> list[int] | DocumentPrompt:
        if not any("kvreuse" in m for m in messages):  # render_chat checks the marks (ValueError)
            return self.chat_token_ids(messages)
        from kvreuse.api.chat_prompt import render_chat
        from kvreuse.api.protocol import ChatMessage

        try:
            rendered = render_chat(self.tokenizer, [ChatMessage(**m) for m in messages])
        except Exception as exc:  # noqa: BLE001 - APIError, pydantic's ValidationError: the caller's messages
            raise ValueError(str(exc)) from None
        return rendered.documents if rendered.documents is not None else rendered.token_ids

    def chat_token_ids(self, messages: list[dict]) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="generating", unit="req")
        try:
            while len(final) < len(request_ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if progress is not None:
                            progress.update(1)
        finally:
            if progress is not None:
                progress.close()
            for rid in request_ids:
                if rid not in final:
                    self.engine.abort_request(rid)
        self.engine.pool.check_integrity()
        return [final[rid] for rid in request_ids]

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def get_kv_cache_events(self, timeout: float = 0.0) -> list[dict]:
        """KV cache events since the previous call, as JSON-ready dicts (TensorRT-LLM's
        shape; docs/events.md), waiting up to ``timeout`` s for one. ``[]`` when events are
        off (``event_buffer_max_size=0``)."""
        events = getattr(self.engine, "events", None)  # the engine's EventBuffer, if any
        return [] if events is None else [event_to_json(e) for e in events.drain_since_last(timeout)]
