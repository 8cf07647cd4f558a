"""Trace replay: prefix-semantics hits, output blocks, retention through the JSONL format,
Belady as the bound, the real Mooncake trace (a slice), and the ``kvreuse simulate`` CLI."""

import json
from pathlib import Path

import pytest

from kvreuse.cache.eviction import make_policy
from kvreuse.simulator.belady import replay_belady
from kvreuse.simulator.cli import simulate_main
from kvreuse.simulator.replay import replay
from kvreuse.simulator.traces import read_trace

MOONCAKE = Path(__file__).resolve().parents[2] / "data" / "traces" / "mooncake_conversation_trace.jsonl"


def write(tmp_path, records, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_mooncake_keys_chain_and_skip_the_partial_block(tmp_path):
    path = write(
        tmp_path,
        [
            {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
            {"timestamp": 1000, "input_length": 1030, "output_length": 600, "hash_ids": [0, 1, 4]},
            {"timestamp": 2000, "input_length": 1030, "output_length": 0, "hash_ids": [0, 3, 5]},
        ],
    )
    trace = read_trace(path, block_tokens=512)
    a, b, c = trace.requests
    assert len(a.block_keys) == 2 and a.block_keys == b.block_keys  # ids 2, 4 cover partial blocks
    assert c.block_keys[0] == a.block_keys[0] and c.block_keys[1] != a.block_keys[1]
    assert (b.timestamp_s, trace.num_block_lookups) == (1.0, 9)
    result = replay(trace, make_policy("lru"), 8, check_every=1)
    # b hits both blocks of a; c hits only the shared first block (prefix semantics)
    assert result.cached_tokens == 1024 + 512 and result.prompt_tokens == 1100 + 1030 + 1030
    # cached: a's 2 full prompt blocks (its partial tail is not), b's one full output block
    # (1030 + 599 tokens with KV = 3 full blocks, 2 of them hits), c's new second block
    assert result.blocks_by_priority == {35: 4} and result.evictions == 0


def test_block_aligned_prompt_never_hits_its_last_block(tmp_path):
    """As in the engine: the block holding the last prompt token is always computed, and the
    last sampled token has no KV (two requests of 8 + 1 tokens fit 2 blocks of 4)."""
    rec = {"prompt_token_ids": list(range(8)), "output_length": 1}
    trace = read_trace(write(tmp_path, [rec, rec]), block_tokens=4)
    result = replay(trace, make_policy("lru"), 2, check_every=1)
    assert (result.requests_rejected, result.cached_tokens, result.prompt_tokens) == (0, 4, 16)
    assert replay_belady(trace, 2).cached_tokens == 4


def test_outputs_occupy_the_cache_and_force_evictions(tmp_path):
    # 4-token blocks: each request = 5 prompt tokens + 8 output tokens, 12 with KV: the
    # prompt's full block and 2 blocks of prompt tail + output, all full
    def rec(t, ts):
        return {"prompt_token_ids": t, "output_length": 8, "timestamp": ts}

    path = write(tmp_path, [rec([1, 2, 3, 4, 50], 0), rec([5, 6, 7, 8, 60], 1), rec([1, 2, 3, 4, 70], 2)])
    trace = read_trace(path, block_tokens=4)
    lru = replay(trace, make_policy("lru"), 3, check_every=1)
    # the second request needs all 3 blocks: outputs first (leaves), then [1,2,3,4]
    assert lru.cached_tokens == 0 and lru.evictions == 6
    assert lru.evictions_by_priority == {35: 6}
    roomy = replay(trace, make_policy("lru"), 6, check_every=1)
    assert (roomy.cached_tokens, roomy.evictions) == (4, 2)  # the third request evicts outputs only


def test_retention_in_jsonl_keeps_the_system_prompt(tmp_path):
    keep = {
        "token_range_retention_configs": [{"token_start": 0, "token_end": 4, "priority": 90}],
        "decode_retention_priority": 10,
    }
    path = write(
        tmp_path,
        [
            # S (90), question (35), 2 output blocks (10): 8 + 9 - 1 tokens with KV
            {"prompt_token_ids": [1, 2, 3, 4, 9, 9, 9, 9], "output_length": 9, "kv_cache_retention_config": keep},
            {"prompt_token_ids": [5, 6, 7, 8], "output_length": 5},  # 2 blocks at 35: the pool is full
            {"prompt_token_ids": [7, 7, 7, 7], "output_length": 13},  # needs 4 blocks
            {"prompt_token_ids": [1, 2, 3, 4, 5], "kv_cache_retention_config": keep},  # S + 1 new block
        ],
    )
    trace = read_trace(path, block_tokens=4)
    assert trace.requests[0].retention.decode_retention_priority == 10
    prio = replay(trace, make_policy("priority"), 6, check_every=1)
    lru = replay(trace, make_policy("lru"), 6, check_every=1)
    # LRU evicts the oldest leaves, the first chain down to S; priority evicts the two
    # decode blocks (10), then the oldest 35 leaves (question, then the second prompt's
    # output); the last request then evicts one more 35 leaf for its own second block
    assert (prio.cached_tokens, lru.cached_tokens) == (4, 0)
    assert prio.evictions_by_priority == {10: 2, 35: 3}
    assert lru.evictions_by_priority == {10: 2, 35: 3, 90: 1}
    assert prio.blocks_by_priority == {35: 4, 90: 1}


def test_jsonl_text_and_errors(tmp_path):
    trace = read_trace(write(tmp_path, [{"text": "abcdefgh"}, {"text": "abcd"}]), block_tokens=4)
    assert trace.requests[1].block_keys == trace.requests[0].block_keys[:1]
    assert trace.requests[1].timestamp_s == 1.0  # one request a second without timestamps
    bad = write(tmp_path, [{"prompt_token_ids": [1], "kv_cache_retention_config": {"decode_retention_priority": 500}}])
    with pytest.raises(ValueError, match=r"line 1: kv_cache_retention_config.decode_retention_priority"):
        read_trace(bad, block_tokens=4)
    with pytest.raises(ValueError, match="line 1: needs prompt_token_ids"):
        read_trace(write(tmp_path, [{"prompt": "x"}]), block_tokens=4)


def test_mooncake_slice_belady_bounds_every_policy():
    trace = read_trace(MOONCAKE, block_tokens=512, limit=600)
    rates = {
        n: replay(trace, make_policy(n, num_blocks=1000), 1000, check_every=200).hit_rate
        for n in ("lru", "priority", "2q")
    }
    bound = replay_belady(trace, 1000, check_every=200).hit_rate
    assert rates["lru"] == rates["priority"]  # no hints in the trace
    assert rates["lru"] < rates["2q"] <= bound
    assert rates["lru"] > 0.0 and bound < 0.5


def test_cli_json_and_plot(tmp_path, capsys):
    def rec(t):
        return {"prompt_token_ids": t, "output_length": 4}

    path = write(tmp_path, [rec(list(range(16))), rec(list(range(100, 116))), rec(list(range(16)))])
    png = tmp_path / "sweep.png"
    assert (
        simulate_main(
            [
                "--trace",
                str(path),
                "--capacity-blocks",
                "8",
                "--trace-block-tokens",
                "4",
                "--policy",
                "lru",
                "--policy",
                "2q",
                "--json",
                "--plot",
                str(png),
                "--sweep",
                "4,8",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in doc["policies"]] == ["lru", "2q"]
    assert set(doc["policies"][0]) >= {"policy", "hit_rate", "evictions_by_priority", "blocks_by_priority"}
    assert doc["belady"]["hit_rate"] >= doc["policies"][0]["hit_rate"]
    assert png.stat().st_size > 1000
    assert simulate_main(["--trace", str(path), "--capacity-blocks", "8", "--trace-block-tokens", "4"]) == 0
    assert "belady (bound)" in capsys.readouterr().out
    assert simulate_main(["--trace", str(tmp_path / "missing.jsonl"), "--capacity-blocks", "8"]) == 2


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--block-size", "0"], "--trace-block-tokens must be >= 1"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--plot", "x.png", "--sweep", "10,abc"], "--sweep takes positive block counts"),
        (["--plot", "x.png", "--sweep", "0,10"], "--sweep takes positive block counts"),
        (["--sweep", "4,8"], "add --plot"),
    ],
)
def test_cli_refuses_bad_options_in_one_line(tmp_path, capsys, extra, needle):
    path = write(tmp_path, [{"prompt_token_ids": [1, 2, 3]}])
    assert simulate_main(["--trace", str(path), "--capacity-blocks", "8", *extra]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


@pytest.mark.parametrize(
    "records, needle",
    [
        ([{"prompt_token_ids": [1], "timestamp": [5]}], "line 1: timestamp must be a number"),
        ([{"prompt_token_ids": [1], "timestamp": "soon"}], "line 1: timestamp must be a number"),
        (
            [{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": [0]}],
            "line 1: input_length must be >= 1",
        ),
    ],
)
def test_trace_reader_names_the_bad_line(tmp_path, records, needle):
    with pytest.raises(ValueError, match=needle):
        read_trace(write(tmp_path, records), block_tokens=4)


def test_blank_first_line_does_not_confuse_the_format(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text('\n{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [0, 1]}\n')
    assert simulate_main(["--trace", str(path), "--capacity-blocks", "8", "--json", "--policy", "lru"]) == 0
    assert json.loads(capsys.readouterr().out)["block_size"] == 512  # read as Mooncake
