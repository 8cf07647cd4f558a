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
def running_server(
    port: int, args: Sequence[str], log: Path, startup_s: float = 180, env_path: str | None = None
) -> Iterator[str]:
    """``python -m kvreuse serve --port PORT ARGS`` with its output in ``log``; yields its base
    URL once /health answers 200, terminates it afterwards (killed if it does not stop in 15 s).
    ``env_path``: the ``PYTHONPATH`` it runs with (another checkout's ``src``, for benches).
    Raises ``RuntimeError`` with the log if it exits or does not come up in ``startup_s``."""
    with running_servers([(port, args, log)], startup_s, env_path=env_path) as (url,):
        yield url


@contextmanager
def running_servers(
    servers: Sequence[tuple[int, Sequence[str], Path]], startup_s: float = 180, env_path: str | None = None
) -> Iterator[list[str]]:
    """``running_server`` for several ``(port, args, log)`` at once: all are started before
    any is waited for (they load their models side by side); yields their URLs in order."""
    procs: list[subprocess.Popen] = []
    try:
        for port, args, log in servers:
            cmd = [sys.executable, "-m", "kvreuse", "serve", "--port", str(port), *args]
            with open(log, "w") as out:
                env = {**os.environ, "NO_COLOR": "1"}
                if env_path is not None:
                    env["PYTHONPATH"] = env_path
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + startup_s
        urls = [_wait_healthy(proc, port, log, deadline) for proc, (port, _, log) in zip(procs, servers)]
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path, deadline: float) -> str:
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"kvreuse serve exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"kvreuse serve did not come up:\n{log.read_text()}")
        time.sleep(0.25)
