"""Over HTTP, a request the engine step fails alone (``--debug-step-fault``) costs only that
request: a stream gets the OpenAI-shaped error event mid-way, a whole response is a 500, both
with code ``request_failed`` (a router passes them on), and the streams beside it, already
running, complete with the text an undisturbed run gives."""

from __future__ import annotations

import asyncio
import json

import httpx

from .fresh_app import fresh_server

PROMPTS = {f"ok-{i}": list(range(300 + 50 * i, 340 + 50 * i)) for i in range(3)}


async def _stream(client: httpx.AsyncClient, request_id: str, prompt: list[int], started: asyncio.Event | None = None):
    """``(text, error event or None)`` of one streamed greedy completion."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "request_id": request_id,
    }
    text, error = "", None
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                error = event
            else:
                text += event["choices"][0]["text"]
                if started is not None:
                    started.set()
    return text, error


async def _run(url: str, *, with_fault: bool) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        started = {rid: asyncio.Event() for rid in PROMPTS}
        tasks = {
            rid: asyncio.ensure_future(_stream(client, rid, prompt, started[rid])) for rid, prompt in PROMPTS.items()
        }
        if with_fault:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started.values())), 30)  # all three mid-stream
            tasks["fault-1"] = asyncio.ensure_future(_stream(client, "fault-1", list(range(700, 740))))
        await asyncio.gather(*tasks.values())
        return {rid: task.result() for rid, task in tasks.items()}


def test_the_failing_stream_alone_gets_the_error_event(tiny_llama):
    config = {"kv_cache_memory_gib": 0.005, "debug_step_faults": ("forward:fault-@5", "sample:whole-")}
    with fresh_server(tiny_llama, **config) as (url, engine):
        undisturbed = asyncio.run(_run(url, with_fault=False))
        disturbed = asyncio.run(_run(url, with_fault=True))

        text, error = disturbed.pop("fault-1")
        assert error == {
            "error": {
                "message": "internal engine error: InjectedFault: injected forward fault (request fault-1-0)",
                "type": "internal_server_error",
                "param": None,
                "code": "request_failed",
            }
        }
        assert text  # its first tokens were streamed before it failed
        assert disturbed == undisturbed
        assert all(error is None and text for text, error in disturbed.values())

        whole = httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "request_id": "whole-1"},
            timeout=60,
        )
        assert whole.status_code == 500
        assert whole.json()["error"] == {
            "message": "internal engine error: InjectedFault: injected post-processing fault (request whole-1-0)",
            "type": "internal_server_error",
            "param": None,
            "code": "request_failed",
        }
        stats = asyncio.run(engine.call(lambda e: e.stats()))
        assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
        asyncio.run(engine.check_integrity())
