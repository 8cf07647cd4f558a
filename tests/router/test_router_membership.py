"""Executors that join a running router and leave it for good (Ray Serve replicas,
``kvreuse.ray_serve``): ``Router.add_executor`` makes one a candidate with its own index
mirror; ``Router.retire_executor`` takes it out of routing and the index, and keeps it
listed (down) so a request that already tried it can still name it."""

from __future__ import annotations

import asyncio

import httpx

from kvreuse.router.executors import Executor
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher, RequestKeys
from kvreuse.router.router import Router

A, B = "http://a.replica", "http://b.replica"
KEYS = RequestKeys(48, [11, 12, 13])


def _router() -> Router:
    return Router(
        [], PromptHasher(None, HashSettings("m", 16, "sha256")), make_policy("kv"), client=httpx.AsyncClient()
    )


def test_an_executor_added_later_is_routed_to_by_its_blocks():
    router = _router()
    assert router.decide(KEYS) is None  # nobody to route to yet
    router.add_executor(Executor(A, healthy=True))
    router.add_executor(Executor(B, healthy=True))
    router.index.store(B, [11, 12])
    routed = router.decide(KEYS)
    assert routed is not None and routed.decision.choice == B
    assert {c.name: c.overlap_blocks for c in routed.candidates} == {A: 0, B: 2}
    assert [router.executors[n].id for n in (A, B)] == [0, 1]
    router.index.check_integrity()


def test_a_retired_executor_leaves_routing_and_the_index_but_stays_listed():
    async def scenario() -> Router:
        router = _router()
        router.add_executor(Executor(A, healthy=True))
        router.add_executor(Executor(B, healthy=True))
        router.index.store(B, [11, 12])
        await router.retire_executor(B)
        await router.retire_executor(B)  # twice: a no-op
        await router.retire_executor("http://unknown.replica")  # unknown: a no-op
        return router

    router = asyncio.run(scenario())
    routed = router.decide(KEYS)
    assert routed is not None and [c.name for c in routed.candidates] == [A]
    assert list(router.executors) == [A, B]
    assert router.retired == {B}
    assert router.executors[B].healthy is False and router.executors[B].last_error == "retired"
    assert router.index.overlaps(KEYS.keys, [B]) == {B: 0}
    router.index.check_integrity()
