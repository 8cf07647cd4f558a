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


def test_ctrl_c_during_the_build_waits_for_its_cleanup(tmp_path):
    """SIGINT while the build runs: the loader gets the interrupt too and its cleanup (a GGUF
    conversion's temporary folder) runs before the process leaves with KeyboardInterrupt
    (review: a second join() returned at once, the daemon loader died with its folder left)."""
    import subprocess
    import sys

    marker = tmp_path / "cleanup-ran"
    script = f"""
import os, signal, threading, time
from kvreuse import cli
def build():
    try:
        while True:
            time.sleep(0.01)
    finally:
        time.sleep(0.3)  # a cleanup that takes a while
        open({str(marker)!r}, "w").write("yes")
threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    cli._off_main_thread(build)
except KeyboardInterrupt:
    print("interrupted", os.path.exists({str(marker)!r}))
    raise SystemExit(130)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 130, out.stderr
    assert out.stdout.strip() == "interrupted True"
