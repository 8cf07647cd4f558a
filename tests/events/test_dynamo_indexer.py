"""NVIDIA Dynamo's own standalone KV indexer (ai-dynamo-runtime, ``python -m dynamo.indexer``)
routes to two real ``kvreuse serve`` executors (tiny random-weight Llama) from their ZMQ KV
events alone: 40 requests of 4 prefix groups, each sent where the indexer's ``/query`` scores
highest, land on the executor that computed the group, and hit its cache. Runs only where
``KVREUSE_DYNAMO_PYTHON`` names a Python with Dynamo installed (not a kvreuse dependency:
tests/events/dynamo_indexer.py says how); the contract test covers the wire format always."""

from __future__ import annotations

import pytest

from tests.events.dynamo_indexer import DYNAMO_PYTHON_ENV, dynamo_python, route_prefix_groups, running_indexer
from tests.serve_client import complete
from tests.serve_process import free_port, running_servers

BLOCK = 16
TINY = ["--model", "tiny:llama", "--served-model-name", "tiny", "--kv-cache-memory", "0.004", "--max-model-len", "2048"]


@pytest.fixture(scope="module")
def dynamo():
    python = dynamo_python()
    if python is None:
        pytest.skip(f"Dynamo not installed: set {DYNAMO_PYTHON_ENV} to a Python with ai-dynamo-runtime")
    return python


def test_dynamos_indexer_routes_4_prefix_groups_to_their_holders(dynamo, tmp_path):
    zmq_ports = {1: free_port(), 2: free_port()}
    servers = [
        (free_port(), [*TINY, "--kv-events-endpoint", f"tcp://*:{zmq_ports[wid]}"], tmp_path / f"{wid}.log")
        for wid in (1, 2)
    ]
    with running_servers(servers) as urls:
        workers = {wid: f"tcp://127.0.0.1:{port}" for wid, port in zmq_ports.items()}
        with running_indexer(dynamo, free_port(), workers, BLOCK, tmp_path / "indexer.log") as indexer:
            result = route_prefix_groups(
                indexer, dict(zip((1, 2), urls)), lambda url, p: complete(url, p, max_tokens=1).cached_tokens
            )
    assert result["share_to_holder"] >= 0.9, result
    assert result["to_holder"] == 40
    assert all(r["cached_tokens"] == 256 for r in result["requests"])  # the 16 prefix blocks, a hit each time
