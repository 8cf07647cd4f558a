"""``kvreuse serve`` builds its model and engine off the main thread (cli._off_main_thread),
in a thread that has ended before serving starts, so the engine thread's OpenMP team is the
only one (the speed effect is bench/docs_ttft.py's): the result comes back, an error is raised
in the caller with its type, and no loading thread is left."""

import threading

import pytest

from kvreuse import cli


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
