"""The live dashboard (SPEC 8) and the JSON it polls.

    GET /dashboard            one self-contained HTML page (inline JS and SVG, no CDN)
    GET /v1/kv_cache_stats    the engine's cache statistics as JSON, exact as of now

The page polls ``/v1/kv_cache_stats`` every second (blocks free / cached / in use, blocks
held and evicted by priority, prefix-cache hit rate) and follows the last 50 events of
``/v1/kv_cache_events/stream``; when events are off it says how to turn them on.

API key: ``/dashboard`` itself is open (it holds no data); the page sends
``Authorization: Bearer <key>`` on its ``/v1`` calls, the key coming from ``?api_key=`` in
the page's URL or typed into the page after a 401 (kept in the tab's ``sessionStorage``).
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from kvreuse.server.context import context_of

router = APIRouter()


@cache
def dashboard_html() -> str:
    """The page's text (``dashboard.html`` next to this module), read once."""
    return files("kvreuse.server").joinpath("dashboard.html").read_text(encoding="utf-8")


@router.get("/dashboard", include_in_schema=False)
async def dashboard() -> HTMLResponse:
    return HTMLResponse(dashboard_html(), headers={"Cache-Control": "no-cache"})


@router.get("/v1/kv_cache_stats")
async def kv_cache_stats(request: Request) -> dict[str, Any]:
    """Block counts (``free + cached + used == total``), blocks held and evicted per
    retention priority, cumulative prefix-cache queries and hits in prompt tokens, request
    queue lengths, and the event buffer's state (``enabled: false`` when events are off).

    Read on the engine thread between steps, so it reflects every request that has
    already returned (``/metrics`` reads the snapshot published after the last step)."""
    ctx = context_of(request)
    s = await ctx.engine.fresh_stats()
    events: dict[str, Any] = {"enabled": ctx.events is not None}
    if ctx.events is not None:
        events.update(ctx.events.buffer.stats())
    q, h = s.prefix_cache_queries_tokens, s.prefix_cache_hits_tokens
    return {
        "model": ctx.served_model_names[0],
        "num_blocks": s.num_blocks,
        "num_free_blocks": s.num_free_blocks,
        "num_cached_blocks": s.num_cached_blocks,
        "num_used_blocks": s.num_used_blocks,
        "blocks_by_priority": {str(p): n for p, n in sorted(s.blocks_by_priority.items())},
        "evictions_by_priority": {str(p): n for p, n in sorted(s.evictions_by_priority.items())},
        "prefix_cache": {"queries_tokens": q, "hits_tokens": h, "hit_rate": h / q if q else 0.0},
        "num_running": s.num_running,
        "num_waiting": s.num_waiting,
        "num_preemptions": s.num_preemptions,
        "tokens_computed": s.tokens_computed,
        "events": events,
        "tiers": _tiers(s),
    }


def _tiers(s: Any) -> dict[str, Any]:
    """Per tier below the device pool (``{}`` without any): hits in prompt tokens, and the
    host tier's occupancy, moves and occupancy by priority (``docs/tiers.md``)."""
    if not s.tiers:
        return {}
    from kvreuse.events.records import DISK_LEVEL, HOST_LEVEL, OBJECT_LEVEL, REMOTE_LEVEL, TIER_NAMES

    host = s.tiers.get(HOST_LEVEL, {})
    return {
        "hits_tokens": {TIER_NAMES.get(k, k): v for k, v in sorted(s.prefix_cache_hits_tokens_by_tier.items())},
        "host": {
            "num_blocks": host.get("num_blocks", 0),
            "num_cached_blocks": host.get("num_cached_blocks", 0),
            "offloaded_blocks": host.get("offloaded_blocks", 0),
            "onboarded_blocks": host.get("onboarded_blocks", 0),
            "loaded_blocks": host.get("loaded_blocks", 0),
            "blocks_by_priority": {
                k.removeprefix("blocks_priority_"): v for k, v in host.items() if k.startswith("blocks_priority_")
            },
        },
        "stores": {
            TIER_NAMES[level]: s.tiers[level] for level in (DISK_LEVEL, REMOTE_LEVEL, OBJECT_LEVEL) if level in s.tiers
        },
    }
