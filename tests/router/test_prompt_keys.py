"""PromptHasher: its memo shared by threads, and prompts whose token ids cannot be hashed."""

from __future__ import annotations

import random
import sys
import threading

from kvreuse.cache.hashing import hash_token_blocks
from kvreuse.router.index import index_key
from kvreuse.router.prompt_keys import HashSettings, PromptHasher, RequestKeys

BS = 16


def test_memo_shared_by_threads_gives_exact_keys():
    # The router hashes in asyncio.to_thread: several threads walk, fill and trim one memo.
    # A small memo keeps it trimming (the unguarded trim raised "dictionary changed size
    # during iteration" and KeyError); a tiny switch interval makes the threads interleave.
    hasher = PromptHasher(None, HashSettings("m", BS, "sha256"), memo_blocks=64)
    rng = random.Random(0)
    prompts = [[rng.randrange(50) for _ in range(BS * rng.randrange(1, 6))] for _ in range(200)]
    expected = [[index_key(h) for h in hash_token_blocks(p, BS, model_id="m")] for p in prompts]
    errors: list[str] = []
    wrong: list[int] = []

    def work(offset: int) -> None:
        for round_ in range(4):
            for i in range(len(prompts)):
                j = (i * 7 + offset + round_) % len(prompts)
                try:
                    if hasher.keys(prompts[j]) != expected[j]:
                        wrong.append(j)
                except Exception as exc:  # noqa: BLE001 - collected, asserted empty below
                    errors.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    assert wrong == []
    assert len(hasher._memo) <= 64


def test_token_ids_outside_int64_get_no_keys():
    hasher = PromptHasher(None, HashSettings("m", BS, "sha256"))
    # hash_block packs ids as signed 64-bit: these cannot be hashed, so the request is
    # routed by load and the executor answers it (a 400).
    assert hasher.request_keys(False, {"prompt": [10**30] * 40}) == RequestKeys(0, [])
    assert hasher.request_keys(False, {"prompt": [2**63] * BS}) == RequestKeys(0, [])
    assert hasher.request_keys(False, {"prompt": [-(2**63) - 1] * BS}) == RequestKeys(0, [])
    # The int64 range itself still hashes.
    edge = [2**63 - 1] * BS + [-(2**63)] * BS
    assert hasher.request_keys(False, {"prompt": edge}) == RequestKeys(
        2 * BS, [index_key(h) for h in hash_token_blocks(edge, BS, model_id="m")]
    )
