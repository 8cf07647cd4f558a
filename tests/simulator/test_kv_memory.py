"""``kvreuse simulate --capacity-gib G --kv-cache-dtype F``: the pool holds what the engine's pool
holds in that format (bytes per token as engine/kv_quant.py counts them), and int8 holds more
blocks, hence more hits, in the same memory."""

import json

import pytest
import torch

from kvreuse.engine.kv_quant import KVFormat
from kvreuse.simulator.cli import simulate_main
from kvreuse.simulator.kv_memory import KV_FORMAT_BYTES, blocks_in, kv_bytes_per_token


@pytest.mark.parametrize("name", sorted(KV_FORMAT_BYTES))  # every format the simulator counts
def test_bytes_per_token_are_the_engines(name):
    engine = KVFormat.resolve(name, torch.bfloat16).bytes_per_token(30, 3, 64)
    assert kv_bytes_per_token(name) == engine
    assert kv_bytes_per_token(name, (2, 2, 16)) == KVFormat.resolve(name, torch.float32).bytes_per_token(2, 2, 16)


def test_blocks_in_a_budget():
    assert kv_bytes_per_token("bfloat16") == 23_040 and kv_bytes_per_token("int8") == 11_880
    assert blocks_in(1.0, "bfloat16", 16) == 2**30 // (23_040 * 16) == 2_912
    assert blocks_in(1.0, "int8", 16) == 2**30 // (11_880 * 16) == 5_648


def _trace(tmp_path):
    path = tmp_path / "t.jsonl"
    prompts = [list(range(p * 7, p * 7 + 64)) for p in range(6)] * 3  # six prompts, each seen three times
    path.write_text("".join(json.dumps({"prompt_token_ids": ids, "output_length": 1}) + "\n" for ids in prompts))
    return path


def _run(capsys, *argv):
    assert simulate_main([*argv, "--json", "--policy", "lru"]) == 0
    return json.loads(capsys.readouterr().out)


def test_int8_holds_more_blocks_and_hits_more_in_the_same_memory(tmp_path, capsys):
    trace = str(_trace(tmp_path))
    common = ["--trace", trace, "--trace-block-tokens", "16", "--kv-layout", "2,2,16"]
    gib = 12 * 16 * 512 / 2**30  # 12 blocks of fp32 (512 bytes a token): half the 24 the prompts take
    fp32 = _run(capsys, *common, "--capacity-gib", str(gib), "--kv-cache-dtype", "float32")
    int8 = _run(capsys, *common, "--capacity-gib", str(gib), "--kv-cache-dtype", "int8")
    assert fp32["capacity_blocks"] == 12 and int8["capacity_blocks"] == 12 * 512 // 144 == 42
    assert int8["kv_cache_dtype"] == "int8" and fp32["capacity_gib"] == gib
    assert (
        fp32["policies"][0]["hit_rate"] == 0 and int8["policies"][0]["hit_rate"] == 0.5
    )  # LRU over a cycle: all or none
    by_blocks = _run(capsys, *common, "--capacity-blocks", "42")
    assert by_blocks["policies"][0]["hit_rate"] == int8["policies"][0]["hit_rate"]


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "give one of --capacity-blocks N or --capacity-gib G"),
        (["--capacity-blocks", "4", "--capacity-gib", "1"], "give one of"),
        (["--capacity-blocks", "4", "--host-gib", "1"], "--host-gib goes with --capacity-gib"),
        (["--capacity-gib", "1", "--kv-layout", "2,2"], "--kv-layout takes LAYERS,KV_HEADS,HEAD_DIM"),
    ],
)
def test_bad_sizes_name_the_flag(tmp_path, capsys, argv, message):
    assert simulate_main(["--trace", str(_trace(tmp_path)), *argv]) == 2
    assert message in capsys.readouterr().err
