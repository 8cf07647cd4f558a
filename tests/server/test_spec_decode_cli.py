"""`kvreuse serve --speculative-tokens K [--speculative-ngram N --speculative-ngram-min M]`: the
flags reach the engine config, a bad value is refused naming its flag, and a real server
started with them speculates (usage says so) while a request opting out does not."""

from __future__ import annotations

import httpx
import pytest

from kvreuse.cli import _engine_config, build_parser
from kvreuse.engine.config import EngineConfig
from tests.serve_process import free_port, running_server

from .test_spec_decode_api import prompt_ids


def _args(*flags: str):
    return build_parser().parse_args(["serve", "--model", "tiny:llama", *flags])


def test_speculative_flags_default_to_the_config_and_reach_it():
    config = _engine_config(_args())
    assert (
        (config.speculative_tokens, config.speculative_ngram_max, config.speculative_ngram_min)
        == (EngineConfig.speculative_tokens, EngineConfig.speculative_ngram_max, EngineConfig.speculative_ngram_min)
        == (0, 4, 2)
    )
    config = _engine_config(
        _args("--speculative-tokens", "6", "--speculative-ngram", "3", "--speculative-ngram-min", "1")
    )
    assert (config.speculative_tokens, config.speculative_ngram_max, config.speculative_ngram_min) == (6, 3, 1)


@pytest.mark.parametrize(
    "flags, name",
    [
        (("--speculative-tokens", "-1"), "--speculative-tokens"),
        (("--speculative-tokens", "33"), "--speculative-tokens"),
        (("--speculative-ngram-min", "5"), "--speculative-ngram-min"),
        (("--speculative-ngram", "0", "--speculative-ngram-min", "0"), "--speculative-ngram-min"),
    ],
)
def test_a_bad_speculative_flag_is_refused_naming_it(flags, name):
    with pytest.raises(ValueError, match=name):
        _engine_config(_args(*flags))


def test_serve_with_speculative_tokens(tmp_path):
    args = [
        "--model",
        "tiny:llama",
        "--kv-cache-memory",
        "0.02",
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
        "--speculative-tokens",
        "5",
        "--speculative-ngram-min",
        "1",
    ]
    body = {"model": "tiny", "prompt": prompt_ids(), "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    with running_server(free_port(), args, tmp_path / "serve.log") as url:
        on = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        off = httpx.post(url + "/v1/completions", json={**body, "speculative": False}, timeout=60).json()
        metrics = httpx.get(url + "/metrics", timeout=10).text
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    d = on["usage"]["completion_tokens_details"]
    assert d["accepted_prediction_tokens"] > 0 and d["rejected_prediction_tokens"] >= 0
    assert "completion_tokens_details" not in off["usage"]
    drafted = d["accepted_prediction_tokens"] + d["rejected_prediction_tokens"]
    assert f'kvreuse:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {float(drafted)}' in metrics
