"""Router overhead: one routing decision for a 32k-token prompt against an index of
1,000,000 blocks (4 executors), median over repeats.

    .venv/bin/python bench/router/router_overhead.py [--blocks 1000000] [--prompt-tokens 32768] [--repeats 200]

Measured separately (JSON in bench/results/router_overhead.json):
- ``decision``: index overlaps for every executor + policy scores + choice, given the
  prompt's block keys (the prompt fully cached on one executor, half on another: the
  longest walk). This is the routing decision proper.
- ``keys_memo_warm``: token ids -> block keys when the prefix was hashed before (the
  router's memo; the common case, since prefixes repeat).
- ``keys_cold``: token ids -> block keys with no memo (2,048 SHA-256 block hashes).
- ``total_warm``: keys_memo_warm + decision, what a repeated-prefix request pays.
Tokenization itself (the executor pays it too) is not included.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from kvreuse.router.index import KVIndex
from kvreuse.router.policy import Candidate, choose, make_policy
from kvreuse.router.prompt_keys import HashSettings, PromptHasher

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
from bench.common import median_ms, write_json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--executors", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", default="bench/results/router_overhead.json")
    args = ap.parse_args()
    rng = random.Random(0)
    settings = HashSettings("bench-model@sha256:0", 16, "sha256")
    tokens = [rng.randrange(49152) for _ in range(args.prompt_tokens)]
    hasher = PromptHasher(None, settings)
    keys = hasher.keys(tokens)
    names = [f"http://executor-{i}" for i in range(args.executors)]
    index = KVIndex()
    for n in names:
        index.add_executor(n)
    index.store(names[0], keys)  # the whole prompt on executor 0
    index.store(names[1], keys[: len(keys) // 2])  # half of it on executor 1
    filler = args.blocks - index.num_keys
    for i, n in enumerate(names):
        share = filler // len(names) + (1 if i < filler % len(names) else 0)
        index.store(n, (rng.getrandbits(64) for _ in range(share)))
    assert index.num_keys >= args.blocks * 0.999, index.num_keys
    policy = make_policy("kv")
    loads = {n: float(rng.randrange(100)) for n in names}

    def decision():
        overlaps = index.overlaps(keys, names)
        cands = [Candidate(n, overlaps[n], len(keys), loads[n], 1) for n in names]
        return choose(policy, cands, rng)

    assert decision().choice == names[0]
    cold = PromptHasher(None, settings, memo_blocks=0)
    result = {
        "index_blocks": index.num_keys,
        "executors": args.executors,
        "prompt_tokens": args.prompt_tokens,
        "prompt_blocks": len(keys),
        "block_size": settings.block_size,
        "hash": settings.hash_algorithm,
        "repeats": args.repeats,
        "decision_ms_median": median_ms(decision, args.repeats),
        "keys_memo_warm_ms_median": median_ms(lambda: hasher.keys(tokens), args.repeats),
        "keys_cold_ms_median": median_ms(lambda: cold.keys(tokens), max(5, args.repeats // 20)),
        "command": "python bench/router/router_overhead.py",
    }
    result["total_warm_ms_median"] = result["decision_ms_median"] + result["keys_memo_warm_ms_median"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out), result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
