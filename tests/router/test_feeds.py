"""Which feed follows an executor: its ZMQ PUB socket where the router can reach it (a
wildcard host becomes the executor's), the HTTP (SSE) feed where the executor advertises its
own loopback from another machine (events bind loopback by default), or no bound socket."""

from __future__ import annotations

import httpx
import pytest

from kvreuse.router.executors import Executor, ExecutorInfo
from kvreuse.router.feeds import SSEFeed, ZmqFeed, reachable_endpoint
from kvreuse.router.policy import make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher
from kvreuse.router.router import Router


@pytest.mark.parametrize(
    ("endpoint", "url", "expected"),
    [
        ("tcp://127.0.0.1:5557", "http://10.0.0.5:8000", None),  # the executor's loopback, not ours
        ("tcp://localhost:5557", "http://gpu-3.internal:8000", None),
        ("tcp://[::1]:5557", "http://10.0.0.5:8000", None),
        ("tcp://127.0.0.1:5557", "http://127.0.0.1:8000", "tcp://127.0.0.1:5557"),  # same machine
        ("tcp://127.0.0.1:5557", "http://localhost:8000", "tcp://127.0.0.1:5557"),
        ("tcp://*:5557", "http://10.0.0.5:8000", "tcp://10.0.0.5:5557"),
        ("tcp://0.0.0.0:5557", "http://gpu-3.internal:8000", "tcp://gpu-3.internal:5557"),
        ("tcp://[::]:5557", "http://[fd00::5]:8000", "tcp://[fd00::5]:5557"),
        ("tcp://10.0.0.5:5557", "http://10.0.0.5:8000", "tcp://10.0.0.5:5557"),  # bound to an address: as given
        ("ipc:///tmp/kv.sock", "http://127.0.0.1:8000", "ipc:///tmp/kv.sock"),
    ],
)
def test_reachable_endpoint(endpoint, url, expected):
    assert reachable_endpoint(endpoint, url) == expected


def _router(url: str, endpoint: str | None, bound: bool = True) -> Router:
    info = ExecutorInfo.from_json(
        url,
        {
            "model": "m",
            "model_id": "m@1",
            "block_size": 16,
            "hash_algorithm": "sha256",
            "events": {"zmq_endpoint": endpoint, "zmq_bound": bound},
        },
    )
    return Router(
        [Executor(url, info, healthy=True)],
        PromptHasher(None, HashSettings("m@1", 16, "sha256")),
        make_policy("kv"),
        client=httpx.AsyncClient(),
    )


@pytest.mark.parametrize(
    ("url", "endpoint", "bound", "feed", "feed_endpoint"),
    [
        ("http://10.0.0.5:8000", "tcp://127.0.0.1:5557", True, SSEFeed, None),
        ("http://127.0.0.1:8000", "tcp://127.0.0.1:5557", True, ZmqFeed, "tcp://127.0.0.1:5557"),
        ("http://10.0.0.5:8000", "tcp://*:5557", True, ZmqFeed, "tcp://10.0.0.5:5557"),
        ("http://10.0.0.5:8000", "tcp://*:5557", False, SSEFeed, None),  # CURVE or connected out: not subscribable
        ("http://10.0.0.5:8000", None, False, SSEFeed, None),
    ],
)
def test_the_router_follows_an_unreachable_publisher_over_http(url, endpoint, bound, feed, feed_endpoint):
    router = _router(url, endpoint, bound)
    chosen = router._feed_for(router.executors[url])
    assert type(chosen) is feed
    assert getattr(chosen, "endpoint", None) == feed_endpoint
