"""prompt_cache_key affinity: a key's requests stay on one executor within the load slack."""

from __future__ import annotations

from kvreuse.router.affinity import MIN_SLACK_BLOCKS, Affinity, prompt_cache_key
from kvreuse.router.policy import Candidate, Decision


def _cands(loads: dict[str, float], prompt_blocks: int = 4) -> list[Candidate]:
    return [Candidate(name, 0.0, prompt_blocks, load, 0) for name, load in loads.items()]


def test_a_key_sticks_to_its_executor_within_the_slack():
    affinity = Affinity()
    first = affinity.apply("agent-1", _cands({"a": 0, "b": 0}), Decision("b", {}))
    assert first.choice == "b" and affinity.owner("agent-1") == "b"
    # the policy now prefers a (less loaded), but b is within the slack: b keeps it
    kept = affinity.apply("agent-1", _cands({"a": 0, "b": MIN_SLACK_BLOCKS}), Decision("a", {"a": 0.0}))
    assert kept == Decision("b", {"a": 0.0}) and affinity.kept == 1
    # past the slack the key moves to the policy's choice
    moved = affinity.apply("agent-1", _cands({"a": 0, "b": MIN_SLACK_BLOCKS + 1}), Decision("a", {}))
    assert moved.choice == "a" and affinity.owner("agent-1") == "a" and affinity.moved == 1


def test_a_long_prompt_widens_the_slack_and_a_gone_executor_moves_the_key():
    affinity = Affinity()
    affinity.apply("k", _cands({"a": 0, "b": 0}), Decision("b", {}))
    assert affinity.apply("k", _cands({"a": 0, "b": 40}, prompt_blocks=40), Decision("a", {})).choice == "b"
    assert affinity.apply("k", _cands({"a": 0}), Decision("a", {})).choice == "a"
    assert affinity.owner("k") == "a"


def test_dry_run_remembers_nothing_and_keys_are_bounded():
    affinity = Affinity(max_keys=2)
    assert affinity.apply("x", _cands({"a": 0}), Decision("a", {}), dry_run=True).choice == "a"
    assert affinity.owner("x") is None
    for key in ("x", "y", "z"):
        affinity.apply(key, _cands({"a": 0}), Decision("a", {}))
    assert affinity.owner("x") is None and affinity.owner("z") == "a"


def test_prompt_cache_key_of_a_body():
    assert prompt_cache_key({"prompt_cache_key": "agent-7"}) == "agent-7"
    assert prompt_cache_key({"prompt_cache_key": ""}) is None
    assert prompt_cache_key({"prompt_cache_key": 5}) is None
    assert prompt_cache_key({"prompt_cache_key": "k" * 1025}) is None
    assert prompt_cache_key([1]) is None
