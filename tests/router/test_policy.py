"""Dry-run decisions (``/v1/route/explain``) change no policy state; ``--overlap-weight`` is checked."""

from __future__ import annotations

import logging
import math
import random

import pytest

from kvreuse.router.cli import route_main
from kvreuse.router.policy import Candidate, KVPolicy, RoundRobinPolicy, choose, make_policy
from kvreuse.router.sim_cli import simulate_main

TIED = [Candidate("a", 0, 1, 0.0, 0), Candidate("b", 0, 1, 0.0, 0), Candidate("c", 0, 1, 0.0, 0)]


def test_a_dry_run_before_each_decision_changes_nothing():
    policy, rng = RoundRobinPolicy(), random.Random(0)
    seen = []
    for _ in range(4):
        explained = choose(policy, TIED[:2], rng, dry_run=True)
        real = choose(policy, TIED[:2], rng)
        seen.append((explained.choice, real.choice))
    # The explain names the choice the real decision then makes; the rotation is a, b, a, b.
    assert seen == [("a", "a"), ("b", "b"), ("a", "a"), ("b", "b")]


def test_a_dry_run_breaks_ties_as_the_next_decision_will():
    policy, rng = KVPolicy(), random.Random(7)
    reference = random.Random(7)
    expected = [reference.choice(["a", "b", "c"]) for _ in range(6)]
    got = []
    for _ in range(6):
        explained = choose(policy, TIED, rng, dry_run=True)
        real = choose(policy, TIED, rng)
        assert explained == real
        got.append(real.choice)
    assert got == expected  # the dry runs drew nothing from the router's rng


@pytest.mark.parametrize("weight", [math.nan, math.inf, -math.inf, -1.0])
def test_overlap_weight_must_be_finite_and_not_negative(weight):
    for name in ("kv", "round_robin", "least_loaded"):
        with pytest.raises(ValueError, match=r"--overlap-weight must be a finite number >= 0, got"):
            make_policy(name, weight)
    with pytest.raises(ValueError, match="--overlap-weight"):
        KVPolicy(weight)


def test_zero_weight_is_load_alone():
    assert make_policy("kv", 0.0).scores([Candidate("a", 0, 4, 3.0, 1), Candidate("b", 4, 4, 5.0, 1)]) == [3.0, 5.0]


def test_simulate_refuses_a_nan_weight(capsys):
    argv = ["--trace", "unread.jsonl", "--executors", "2", "--capacity-blocks", "8", "--overlap-weight", "nan"]
    assert simulate_main(argv) == 2
    assert capsys.readouterr().err.strip() == "kvreuse simulate: --overlap-weight must be a finite number >= 0, got nan"


def test_route_refuses_a_nan_weight_before_looking_for_executors(capsys, monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # route_main sets the root level; put it back after
    # Port 1 answers nobody: were the weight checked after discovery, the error would be "no executor answered".
    assert (
        route_main(
            [
                "--executor",
                "http://127.0.0.1:1",
                "--overlap-weight",
                "nan",
                "--startup-timeout",
                "0",
                "--log-level",
                "warning",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == "kvreuse route: --overlap-weight must be a finite number >= 0, got nan"


def test_route_refuses_a_negative_migration_limit_before_looking_for_executors(capsys, monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)
    assert (
        route_main(
            [
                "--executor",
                "http://127.0.0.1:1",
                "--migration-limit",
                "-1",
                "--startup-timeout",
                "0",
                "--log-level",
                "warning",
            ]
        )
        == 2
    )
    assert capsys.readouterr().err.strip() == "kvreuse route: --migration-limit must be >= 0 (0: off), got -1"
