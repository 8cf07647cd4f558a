"""``GET /v1/kvreuse/info``: what a router needs to know to compute this executor's block keys.

A router must hash a request exactly as this executor does (``kvreuse.cache.hashing``): same
model identity, block size, hash algorithm and tokenizer. It also learns where the
executor publishes KV events (``zmq_bound``: whether the PUB socket is bound at
``zmq_endpoint``, so a subscriber can connect there; a publisher that connects out sends
to whoever bound that address, and a router connecting to it too would hear nothing),
and how far it got (``zmq_last_event_id``: the newest event it has published, so a consumer
that knows a snapshot's ``last_event_id`` knows when the wire has caught up with it),
and the process's ``instance_id`` (new at every start, also on ``/health``).
``remote_store`` identifies the remote store (Redis URL's location and database, and the
namespace; no credentials, hashed) when there is one: executors reporting the same one read
each other's ``REMOTE`` blocks, and a router counts them as reachable from all of them.
``object_store`` does the same for the ``--object-cache`` bucket (endpoint, bucket, prefix
and namespace, hashed): executors reporting the same one read each other's ``OBJECT`` blocks.
``num_blocks`` and ``eos_token_ids`` let a router continue a stream elsewhere exactly as
this executor would have finished it (``kvreuse.router.migration``).
``tokenizer_probe`` holds the token ids of a fixed text and of a fixed chat, so a router
can check that its own tokenizer and chat template agree before it trusts its keys.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from kvreuse.api.probe import tokenizer_probe
from kvreuse.server.context import context_of

if TYPE_CHECKING:
    from kvreuse.events.publisher import ZmqEventPublisher

router = APIRouter()


def _zmq_facts(publisher: ZmqEventPublisher | None) -> dict[str, Any]:
    """Where ``publisher`` sends (all ``None``/defaults without one). ``zmq_bound`` is read
    now: true while its PUB socket is bound and open, so a subscriber can connect; false under
    CURVE (``--kv-events-curve-secret-key``), where only subscribers holding an allowed key can,
    so a router without one follows the executor over HTTP (SSE) instead of hearing nothing."""
    if publisher is None:
        return {
            "zmq_endpoint": None,
            "zmq_bound": False,
            "zmq_replay_endpoint": None,
            "zmq_topic": "",
            "zmq_hash_format": "int",
            "zmq_last_event_id": None,
        }
    return {
        "zmq_endpoint": publisher.endpoint,
        "zmq_bound": publisher.subscribable and publisher.curve is None,
        "zmq_replay_endpoint": publisher.replay_endpoint,
        "zmq_topic": publisher.topic.decode(),
        "zmq_hash_format": publisher.hash_format,
        "zmq_last_event_id": publisher.last_event_id,  # newest buffer event it has sent (-1: none)
    }


@router.get("/v1/kvreuse/info")
async def kvreuse_info(request: Request) -> dict:
    """Process instance id, model identity, cache geometry, hash settings, event transports
    and a tokenizer probe."""
    ctx = context_of(request)
    engine = ctx.engine
    facts, tokenizer = engine.facts, engine.tokenizer
    return {
        "instance_id": ctx.instance_id,
        "model": ctx.served_model_names[0],
        "model_name": facts.model_name,
        "model_id": facts.model_id,
        "model_path": None if facts.model_path is None else str(facts.model_path),
        "tokenizer_path": getattr(tokenizer, "name_or_path", None) or None,
        "block_size": engine.block_size,
        "kv_cache_dtype": facts.kv_cache_dtype,  # the KV format, folded into model_id (formats never share blocks)
        "deterministic": facts.deterministic,  # a hit gives the miss's answer (docs/deterministic.md); in model_id
        "hash_algorithm": facts.hash_algorithm,
        "enable_prefix_caching": facts.enable_prefix_caching,
        "max_model_len": engine.max_model_len,
        "num_blocks": facts.num_blocks,
        "cache_levels": list(facts.cache_levels),
        "remote_store": engine.remote_store,  # live: a cluster down at start settles it later
        "object_store": facts.object_store,
        "eos_token_ids": list(facts.eos_token_ids),  # what ends a request (a router continuing a stream)
        "events": {"http": ctx.events is not None, **_zmq_facts(ctx.publisher)},
        "tokenizer_probe": tokenizer_probe(tokenizer),
    }
