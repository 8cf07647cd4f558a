"""Schema-driven fuzzing of ``kvreuse serve``'s own ``/openapi.json`` (issue 31): the
completions, chat, Messages and count_tokens bodies, positive and negative cases
(``tests.schema_fuzz``), against the live session server over the tiny random Llama. No
answer is a 5xx, every 4xx is in the endpoint's own error shape, and afterwards a normal
request still succeeds and the pool goes back to idle with its integrity intact (the fuzzing
cost nobody any work)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.schema_fuzz import ANTHROPIC_PATHS, MAX_EXAMPLES, MODES, OPENAI_PATHS, fuzz

from .helpers import wait_idle


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", OPENAI_PATHS + ANTHROPIC_PATHS)
def test_fuzzed_bodies_get_no_5xx_and_the_apis_own_error_shape(live_url, path, mode):
    cases, problems = fuzz(live_url, path, mode)
    assert cases == MAX_EXAMPLES
    assert problems == []


def test_after_the_fuzzing_a_normal_request_succeeds_and_the_pool_is_idle(live_url, async_engine):
    r = httpx.post(f"{live_url}/v1/completions", json={"prompt": "after the fuzz", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    stats = wait_idle(async_engine)
    assert (stats.num_used_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)
    asyncio.run(async_engine.check_integrity())
