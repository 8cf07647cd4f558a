"""The router's shared-store reach on a Redis Cluster: two ``kvreuse serve`` executors seeded
with different nodes of one real 3-master cluster report one ``remote_store`` identity, and
behind ``kvreuse route`` a prompt computed on A counts as reachable from B at the REMOTE
weight, exactly as on one redis-server (``test_index_shared_store.py``, whose helpers this
reuses); B then reads it back from the cluster."""

from __future__ import annotations

import httpx
import pytest

from kvreuse.router.policy import DEFAULT_TIER_WEIGHTS
from tests.tiers.redis_cluster import running_cluster

from .cluster import free_port, router, wait_healthy
from .test_index_shared_store import complete, explain_until, tiered_executor


@pytest.fixture(scope="module")
def on_cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("shared-cluster")
    for cluster in running_cluster(logs / "cluster"):
        ports = [free_port(), free_port()]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        seeds = [cluster.url(cluster.ports[0]), cluster.url(cluster.ports[2])]  # A and B: different nodes
        execs = [tiered_executor(p, str(logs), seed).start() for p, seed in zip(ports, seeds)]
        route_port = free_port()
        procs = [*execs, router(route_port, urls, str(logs), "--seed", "0", "--startup-timeout", "300").start()]
        try:
            wait_healthy(f"http://127.0.0.1:{route_port}", procs, timeout=300, all_of=2)
            yield urls, f"http://127.0.0.1:{route_port}"
        finally:
            for p in procs:
                p.stop()


def test_blocks_a_wrote_to_the_cluster_are_reachable_from_b_at_the_remote_weight(on_cluster):
    (a, b), route = on_cluster
    info_a, info_b = (httpx.get(f"{u}/v1/kvreuse/info").json() for u in (a, b))
    assert info_a["remote_store"] == info_b["remote_store"] and len(info_a["remote_store"]) == 16
    usage = complete(a)  # computed on A only; written through to the cluster
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    n = usage["prompt_tokens"] // 16
    d = explain_until(route, lambda o: o[b] > 0)
    assert d["prompt_blocks"] == n
    assert d["overlaps"] == {a: float(n), b: float(sum([DEFAULT_TIER_WEIGHTS["REMOTE"]] * n))}
    on_b = complete(b)  # B reads them back from the cluster
    assert on_b["prompt_tokens_details"]["cached_tokens_by_tier"]["remote"] == (usage["prompt_tokens"] - 1) // 16 * 16
    d = explain_until(route, lambda o: o[b] == float(n))
    assert d["overlaps"] == {a: float(n), b: float(n)}
