"""``kvreuse route``'s flags: bad values stop it with exit 2 and a message naming the flag,
before it waits for any executor."""

from __future__ import annotations

import pytest

from kvreuse.router.cli import build_parser, route_main

DOWN = ["--executor", "http://127.0.0.1:9", "--startup-timeout", "0"]  # nothing listens there


def test_the_deadline_flags_default_to_10_and_300_seconds():
    args = build_parser().parse_args(DOWN)
    assert (args.upstream_progress_timeout, args.upstream_first_byte_timeout) == (10.0, 300.0)


@pytest.mark.parametrize(
    ("flag", "value"), [("--upstream-progress-timeout", "-1"), ("--upstream-first-byte-timeout", "inf")]
)
def test_a_bad_deadline_stops_the_router_naming_the_flag(flag, value, capsys):
    assert route_main([*DOWN, flag, value]) == 2
    assert capsys.readouterr().err == (
        f"kvreuse route: {flag} must be a finite number of seconds >= 0 (0: no limit), got {float(value)}\n"
    )
