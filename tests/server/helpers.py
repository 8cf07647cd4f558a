"""Helpers for the server tests (constants, prompts, waiting for an idle pool)."""

from __future__ import annotations

import asyncio
import time

BLOCK_SIZE = 16
MAX_MODEL_LEN = 512


def wait_idle(engine, timeout: float = 30.0):
    """Wait until no request runs or waits and no block is held; return the stats."""
    deadline = time.monotonic() + timeout
    while True:
        stats = asyncio.run(engine.call(lambda e: e.stats()))
        if stats.num_used_blocks == 0 and stats.num_running == 0 and stats.num_waiting == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"pool never went idle: {stats}")
        time.sleep(0.05)


def words(n: int, seed: int) -> str:
    """A prompt of roughly ``n`` tokens, distinct per ``seed``."""
    vocab = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet"]
    return " ".join(f"{vocab[(i * 7 + seed) % len(vocab)]}{seed}" for i in range(n // 2))
