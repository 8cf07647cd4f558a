"""The router's ``/metrics`` (SPEC 8, "router decisions"): exact counts after known requests,
through the real proxy path, with executors played by an in-process HTTP transport."""

from __future__ import annotations

import asyncio
import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvreuse.router.executors import Executor
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.proxy import forward
from kvreuse.router.router import Router

BS = 4


def _executors(request: httpx.Request) -> httpx.Response:
    """``a`` is overloaded (503: retried elsewhere); ``b`` answers."""
    if request.url.host == "a":
        return httpx.Response(503, json={"error": {"message": "busy"}})
    return httpx.Response(200, json={"choices": [{"text": "ok"}]})


def test_decisions_retries_and_blocks_are_counted_exactly():
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks of 4

    async def run(executor_urls: bool = False) -> tuple[list[int], str]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_executors)) as client:
            executors = [Executor("http://a", healthy=True), Executor("http://b", healthy=True)]
            hasher = PromptHasher(None, HashSettings("m", BS, "sha256"))  # token-id prompts need no tokenizer
            router = Router(
                executors,
                hasher,
                make_policy("round_robin"),
                client=client,
                seed=0,
                metrics_executor_urls=executor_urls,
            )
            statuses = []
            for _ in range(3):
                raw = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
                resp = await forward(router, "/v1/completions", raw, {"content-type": "application/json"}, chat=False)
                statuses.append(resp.status_code)
            return statuses, router.metrics.render()[0].decode()

    statuses, text = asyncio.run(run())
    assert "http://" not in text  # executors by id (--executor order), never by address
    assert statuses == [200, 200, 200]
    m = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    # Round robin offers a first every time (its turn advances per decision); a's 503 sends each to b.
    assert m[("kvreuse:router_decisions_total", frozenset({"executor": "0", "policy": "round_robin"}.items()))] == 3
    assert m[("kvreuse:router_decisions_total", frozenset({"executor": "1", "policy": "round_robin"}.items()))] == 3
    assert m[("kvreuse:router_retries_total", frozenset())] == 3
    assert m[("kvreuse:router_prompt_blocks_total", frozenset())] == 6 * 2  # 6 decisions x 2 full blocks
    assert m[("kvreuse:router_overlap_blocks_total", frozenset())] == 0  # nothing indexed yet
    assert m[("kvreuse:router_executor_up", frozenset({"executor": "1"}.items()))] == 1
    assert m[("kvreuse:router_executor_in_flight", frozenset({"executor": "1"}.items()))] == 0
    assert m[("kvreuse:router_index_keys", frozenset())] == 0
    # --metrics-executor-urls: the same series, labelled with the URLs
    labelled = {
        s.labels.get("executor") for f in text_string_to_metric_families(asyncio.run(run(True))[1]) for s in f.samples
    }
    assert labelled == {None, "http://a", "http://b"}
