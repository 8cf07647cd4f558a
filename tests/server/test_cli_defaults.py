"""The defaults of ``kvreuse serve`` and ``kvreuse schema precompute`` are ``EngineConfig``'s,
read from it, so a default changed there cannot leave a flag behind: every flag follows a
changed config default, and either command run without flags configures ``EngineConfig()``."""

from __future__ import annotations

import pytest

from kvreuse.cli import _engine_config, build_parser
from kvreuse.engine.config import EngineConfig
from kvreuse.pml import schema_cli

# flag dest -> EngineConfig field
SERVE = {"model": "model", "dtype": "dtype", "quantization": "quantization", "device": "device",
         "kv_cache_memory": "kv_cache_memory_gib", "block_size": "block_size", "max_num_seqs": "max_num_seqs",
         "max_model_len": "max_model_len", "enable_prefix_caching": "enable_prefix_caching",
         "prefix_hash_algorithm": "hash_algorithm", "eviction_policy": "eviction_policy",
         "event_buffer_max_size": "event_buffer_max_size", "seed": "seed", "schema_dir": "schema_dir",
         "schema_src_dir": "schema_src_dir", "schema_slice_tokens": "schema_slice_tokens",
         "schema_max_tokens": "schema_max_tokens", "schema_max_bytes": "schema_max_bytes",
         "host_cache_memory": "host_cache_memory_gib", "host_offload_min_priority": "host_offload_min_priority",
         "disk_cache_dir": "disk_cache_dir", "disk_cache_size": "disk_cache_size_gib",
         "disk_cache_ttl": "disk_cache_ttl_s", "remote_cache": "remote_cache",
         "tier_write_through_min_priority": "tier_write_through_min_priority",
         "blend_first_tokens": "blend_first_tokens", "blend_ratio": "blend_ratio",
         "blend_last_tokens": "blend_last_tokens",
         "document_blend_first_tokens": "document_blend_first_tokens",
         "document_blend_ratio": "document_blend_ratio", "document_blend_last_tokens": "document_blend_last_tokens",
         "speculative_tokens": "speculative_tokens", "speculative_ngram": "speculative_ngram_max",
         "speculative_ngram_min": "speculative_ngram_min"}
PRECOMPUTE = {"model": "model", "dtype": "dtype", "quantization": "quantization", "device": "device",
              "kv_cache_memory": "kv_cache_memory_gib", "block_size": "block_size", "max_model_len": "max_model_len",
              "schema_dir": "schema_dir", "schema_max_tokens": "schema_max_tokens",
              "schema_max_bytes": "schema_max_bytes"}


def _serve_args():
    return build_parser().parse_args(["serve"])


def _precompute_args():
    return schema_cli._parser().parse_args(["precompute", "schema.xml"])


@pytest.mark.parametrize("dest, field", sorted(SERVE.items()))
def test_every_serve_flag_follows_a_changed_config_default(monkeypatch, dest, field):
    changed = object()  # argparse keeps a non-string default as it is
    monkeypatch.setattr(EngineConfig, field, changed)
    assert getattr(_serve_args(), dest) is changed


@pytest.mark.parametrize("dest, field", sorted(PRECOMPUTE.items()))
def test_every_precompute_flag_follows_a_changed_config_default(monkeypatch, dest, field):
    changed = object()
    monkeypatch.setattr(EngineConfig, field, changed)
    assert getattr(_precompute_args(), dest) is changed


def test_serve_without_flags_configures_the_default_engine():
    assert _engine_config(_serve_args()) == EngineConfig()


def test_precompute_without_flags_configures_the_default_engine():
    assert schema_cli._engine_config(_precompute_args()) == EngineConfig()
