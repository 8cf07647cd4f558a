"""The defaults of ``kvreuse serve`` and ``kvreuse schema precompute`` are ``EngineConfig``'s,
read from it, so a default changed there cannot leave a flag behind: every flag follows a
changed config default, and either command run without flags configures ``EngineConfig()``.
``kvreuse serve`` builds its model and engine off the main thread; its --blend-* flags."""

from __future__ import annotations

import threading

import pytest

from kvreuse import cli, schema_cli
from kvreuse.cli import _engine_config, build_parser
from kvreuse.engine.config import EngineConfig

# flag dest -> EngineConfig field
SERVE = {
    "model": "model",
    "dtype": "dtype",
    "quantization": "quantization",
    "device": "device",
    "kv_cache_memory": "kv_cache_memory_gib",
    "block_size": "block_size",
    "max_num_seqs": "max_num_seqs",
    "max_model_len": "max_model_len",
    "enable_prefix_caching": "enable_prefix_caching",
    "prefix_hash_algorithm": "hash_algorithm",
    "eviction_policy": "eviction_policy",
    "event_buffer_max_size": "event_buffer_max_size",
    "seed": "seed",
    "schema_dir": "schema_dir",
    "schema_src_dir": "schema_src_dir",
    "schema_slice_tokens": "schema_slice_tokens",
    "schema_max_tokens": "schema_max_tokens",
    "schema_max_bytes": "schema_max_bytes",
    "host_cache_memory": "host_cache_memory_gib",
    "host_offload_min_priority": "host_offload_min_priority",
    "disk_cache_dir": "disk_cache_dir",
    "disk_cache_size": "disk_cache_size_gib",
    "disk_cache_ttl": "disk_cache_ttl_s",
    "remote_cache": "remote_cache",
    "tier_write_through_min_priority": "tier_write_through_min_priority",
    "blend_first_tokens": "blend_first_tokens",
    "blend_ratio": "blend_ratio",
    "blend_last_tokens": "blend_last_tokens",
    "document_blend_first_tokens": "document_blend_first_tokens",
    "document_blend_ratio": "document_blend_ratio",
    "document_blend_last_tokens": "document_blend_last_tokens",
    "speculative_tokens": "speculative_tokens",
    "speculative_ngram": "speculative_ngram_max",
    "speculative_ngram_min": "speculative_ngram_min",
    "deterministic": "deterministic",
}
PRECOMPUTE = {
    "model": "model",
    "dtype": "dtype",
    "quantization": "quantization",
    "device": "device",
    "kv_cache_memory": "kv_cache_memory_gib",
    "block_size": "block_size",
    "max_model_len": "max_model_len",
    "schema_dir": "schema_dir",
    "schema_max_tokens": "schema_max_tokens",
    "schema_max_bytes": "schema_max_bytes",
}


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


def test_serve_prefill_cap_flag_sets_the_engine_field():
    args = build_parser().parse_args(["serve", "--max-prefill-tokens-while-decoding", "48"])
    assert _engine_config(args).max_prefill_tokens_while_decoding == 48
    assert _engine_config(_serve_args()).max_prefill_tokens_while_decoding is None
    with pytest.raises(ValueError, match=r"--max-prefill-tokens-while-decoding must be >= 0 \(0: no cap\), got -1"):
        _engine_config(build_parser().parse_args(["serve", "--max-prefill-tokens-while-decoding", "-1"]))


def test_serve_deterministic_flag_sets_the_engine_field():
    assert _engine_config(build_parser().parse_args(["serve", "--deterministic"])).deterministic is True
    assert _engine_config(build_parser().parse_args(["serve", "--no-deterministic"])).deterministic is False
    assert _engine_config(_serve_args()).deterministic is None  # auto: on where it costs about nothing


def test_serve_debug_step_fault_flags_reach_the_engine_config():
    args = build_parser().parse_args(
        ["serve", "--debug-step-fault", "forward:fault-", "--debug-step-fault", "sample:cut-@20"]
    )
    assert _engine_config(args).debug_step_faults == ("forward:fault-", "sample:cut-@20")
    assert _engine_config(_serve_args()).debug_step_faults == ()
    with pytest.raises(ValueError, match="--debug-step-fault must be"):
        _engine_config(build_parser().parse_args(["serve", "--debug-step-fault", "decode:x"]))


def test_precompute_without_flags_configures_the_default_engine():
    assert schema_cli._engine_config(_precompute_args()) == EngineConfig()


# ``kvreuse serve`` builds its model and engine off the main thread (cli._off_main_thread),
# in a thread that has ended before serving starts, so the engine thread's OpenMP team is the
# only one (the speed effect is bench/prefix/docs_ttft.py's): the result comes back, an error is raised
# in the caller with its type, and no loading thread is left.
def test_the_build_runs_in_another_thread_that_has_ended():
    seen = {}

    def build():
        seen["thread"] = threading.current_thread()
        return 41 + 1

    assert cli._off_main_thread(build) == 42
    assert seen["thread"] is not threading.current_thread()
    assert not seen["thread"].is_alive()


def test_an_error_in_the_build_is_raised_in_the_caller():
    def build():
        raise ValueError("--model: no such model")

    with pytest.raises(ValueError, match="no such model"):
        cli._off_main_thread(build)
    assert not any(t.name == "kvreuse-load" for t in threading.enumerate())


# The test process may hand its children SIGINT blocked or ignored (the full suite in CI did: a
# library blocks it in pytest's main thread, and a child then never saw the signal and hung), so
# each script first restores what an interactive `kvreuse serve` gets from a terminal.
_SIGINT_AS_A_TERMINAL_SENDS_IT = (
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
    "signal.signal(signal.SIGINT, signal.default_int_handler)"
)


def _interrupted_build(tmp_path, sender: str, timeout: float) -> None:
    """Run ``cli._off_main_thread`` in a child on a build that loops until interrupted (its cleanup
    takes 0.3 s, then leaves a marker), ``sender`` arranging the SIGINT; assert the child left with
    KeyboardInterrupt after the cleanup ran."""
    import subprocess
    import sys

    marker = tmp_path / "cleanup-ran"
    script = f"""
import os, signal, threading, time
from kvreuse import cli
{_SIGINT_AS_A_TERMINAL_SENDS_IT}
def build():
    try:
        while True:
            time.sleep(0.01)
    finally:
        time.sleep(0.3)  # a cleanup that takes a while
        open({str(marker)!r}, "w").write("yes")
{sender}
try:
    cli._off_main_thread(build)
except KeyboardInterrupt:
    print("interrupted", os.path.exists({str(marker)!r}))
    raise SystemExit(130)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 130, out.stderr
    assert out.stdout.strip() == "interrupted True"


def test_ctrl_c_during_the_build_waits_for_its_cleanup(tmp_path):
    """SIGINT while the build runs: the loader gets the interrupt too and its cleanup (a GGUF
    conversion's temporary folder) runs before the process leaves with KeyboardInterrupt
    (review: a second join() returned at once, the daemon loader died with its folder left)."""
    _interrupted_build(tmp_path, "threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()", 60)


def test_ctrl_c_taken_by_another_thread_still_interrupts_the_build(tmp_path):
    """The kernel may hand a process-directed SIGINT to any thread; when not the main one, an
    untimed join() never woke to run Python's handler and the process hung (CI, 60 s timeout).
    Here the main thread blocks SIGINT, so another thread takes it for sure."""
    sender = """
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # threads started later inherit it
def fire():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # this thread takes the signal
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=fire, daemon=True).start()
"""
    _interrupted_build(tmp_path, sender, 30)


# `kvreuse serve --blend-*` reach the engine config; a bad value is refused naming the flag.
def _args(*flags: str):
    return build_parser().parse_args(["serve", "--model", "tiny:llama", *flags])


def test_blend_flags_default_to_the_config_and_reach_it():
    config = _engine_config(_args())
    assert (
        (config.blend_first_tokens, config.blend_ratio)
        == (EngineConfig.blend_first_tokens, EngineConfig.blend_ratio)
        == (0, 0.0)
    )
    config = _engine_config(_args("--blend-first-tokens", "8", "--blend-ratio", "0.15"))
    assert (config.blend_first_tokens, config.blend_ratio) == (8, 0.15)
    assert EngineConfig.blend_last_tokens == 0 and _engine_config(_args()).blend.last_tokens == 0
    config = _engine_config(_args("--blend-last-tokens", "2", "--blend-first-tokens", "1"))
    assert (config.blend.first_tokens, config.blend.ratio, config.blend.last_tokens) == (1, 0.0, 2)


@pytest.mark.parametrize(
    "flags, name",
    [
        (("--blend-ratio", "1.5"), "--blend-ratio"),
        (("--blend-first-tokens", "-1"), "--blend-first-tokens"),
        (("--blend-last-tokens", "-1"), "--blend-last-tokens"),
    ],
)
def test_a_bad_blend_flag_is_refused_naming_it(flags, name):
    with pytest.raises(ValueError, match=name):
        _engine_config(_args(*flags))


def test_serve_help_states_the_default_prefill_cap_rule(capsys):
    """Without the flag the CPU cap is 16 or 4 per decoding stream, whichever is more (so the
    default is not the same as ``--max-prefill-tokens-while-decoding 16``); the help says so."""
    from kvreuse.engine.scheduler import default_prefill_cap, default_prefill_per_decode

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    cap, per = default_prefill_cap(None, "cpu"), default_prefill_per_decode(None, "cpu")
    assert (
        f"default on CPU: {cap}, or {per} per decoding stream if more; {default_prefill_cap(None, 'cuda')} on CUDA"
        in text
    )
