"""Routed replay on a small synthetic trace: kv routing keeps conversations together."""

from __future__ import annotations

import json

from kvreuse.router.policy import make_policy
from kvreuse.router.simulation import simulate_routed
from kvreuse.simulator.traces import read_trace


def _trace(tmp_path, conversations: int = 7, turns: int = 6):
    """Conversations whose turns extend the previous prompt, interleaved in time."""
    lines, next_id = [], 0
    prompts = {c: [] for c in range(conversations)}
    for t in range(turns):
        for c in range(conversations):
            prompts[c] = prompts[c] + list(range(next_id, next_id + 3))
            next_id += 3
            ts = (t * conversations + c) * 1000
            lines.append(
                {"timestamp": ts, "input_length": 4 * len(prompts[c]), "output_length": 400, "hash_ids": prompts[c]}
            )
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    return read_trace(path, block_tokens=4)


def test_kv_routing_beats_round_robin_and_stays_balanced(tmp_path):
    trace = _trace(tmp_path)
    rr = simulate_routed(trace, make_policy("round_robin"), executors=4, capacity_blocks=200)
    kv = simulate_routed(trace, make_policy("kv"), executors=4, capacity_blocks=200, window_s=60)
    assert rr.requests == kv.requests == 42
    assert kv.hit_rate > 2 * rr.hit_rate
    assert kv.cached_tokens > 0 and max(kv.requests_per_executor) <= 2 * min(kv.requests_per_executor)
    assert sorted(rr.requests_per_executor) == [10, 10, 11, 11]
    assert kv.to_dict()["imbalance_mean"] >= 1.0
