"""Shared helpers for the tier tests: a namespace, a deterministic block, encoded bytes."""

import pytest
import torch

from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.tiers.block_codec import BlockRecord, encode_block
from kvreuse.tiers.namespace import TierNamespace

BLOCK_SIZE = 4
SHAPE = (2, 2, 2, BLOCK_SIZE, 8)  # [layers, 2, kv_heads, block_size, head_dim]
NS = TierNamespace("ab" * 32, "sha256", BLOCK_SIZE)
OTHER_MODEL = TierNamespace("cd" * 32, "sha256", BLOCK_SIZE)


def make_record(index: int = 0, dtype: torch.dtype = torch.float32) -> BlockRecord:
    """Block ``index`` of the chain over tokens 0..4*(index+1): KV values index*1000 + arange."""
    tokens = list(range(BLOCK_SIZE * (index + 1)))
    keys = hash_token_blocks(tokens, BLOCK_SIZE, model_id="m")
    kv = (torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32) + index * 1000).reshape(SHAPE).to(dtype)
    parent = keys[index - 1] if index else None
    return BlockRecord(keys[index], parent, tuple(tokens[-BLOCK_SIZE:]), kv)


def make_payload(index: int = 0, namespace: TierNamespace = NS) -> tuple[bytes, bytes]:
    """(key, encoded bytes) of ``make_record(index)``."""
    record = make_record(index)
    return record.key, encode_block(record, namespace)


@pytest.fixture
def record() -> BlockRecord:
    return make_record(1)


@pytest.fixture
def redis_server(tmp_path):
    """A running redis-server of this test's own; stopped afterwards (also if killed mid-test)."""
    from .redis_server import RedisServer

    server = RedisServer(tmp_path)
    if server.binary is None:
        pytest.skip("redis-server not on PATH (apt-get install redis-server; .ci/run installs it)")
    server.start()
    yield server
    server.stop()
