"""``kvreuse serve`` as a real subprocess for tests: a free port, start, wait for /health, stop."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(port: int, args: Sequence[str], log: Path, startup_s: float = 180,
                   env_path: str | None = None) -> Iterator[str]:
    """``python -m kvreuse serve --port PORT ARGS`` with its output in ``log``; yields its base
    URL once /health answers 200, terminates it afterwards (killed if it does not stop in 15 s).
    ``env_path``: the ``PYTHONPATH`` it runs with (another checkout's ``src``, for benches).
    Raises ``RuntimeError`` with the log if it exits or does not come up in ``startup_s``."""
    cmd = [sys.executable, "-m", "kvreuse", "serve", "--port", str(port), *args]
    env = {**os.environ, "NO_COLOR": "1"}
    if env_path is not None:
        env["PYTHONPATH"] = env_path
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvreuse serve exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvreuse serve did not come up:\n{log.read_text()}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
