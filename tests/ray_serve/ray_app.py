"""``kvreuse ray`` as a real process for tests and benches: a local Ray cluster on loopback,
Ray Serve's HTTP proxy on a free port, waited for until every replica is routed to."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.serve_process import free_port

TINY_SERVE_FLAGS = ("--model", "tiny:llama", "--device", "cpu", "--kv-cache-memory", "0.01", "--max-model-len", "1024")


def ray_command(port: int, replicas: int, flags: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvreuse",
        "ray",
        "--replicas",
        str(replicas),
        "--port",
        str(port),
        "--health-interval",
        "0.3",
        "--log-level",
        "warning",
        *flags,
    ]


def healthy_replicas(url: str) -> int:
    """How many replicas the ingress routes to now (0 while it is not up)."""
    try:
        resp = httpx.get(f"{url}/health", timeout=2)
    except httpx.HTTPError:
        return 0
    if resp.status_code != 200:
        return 0
    return sum(1 for e in resp.json().get("executors", []) if e.get("healthy"))


@contextmanager
def running_ray_app(
    replicas: int, flags: Sequence[str], log: Path, startup_s: float = 600, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """``kvreuse ray --replicas N FLAGS``; yields ``(base URL, process)`` once ``replicas``
    replicas are healthy; SIGTERM afterwards (the local cluster stops with it), SIGKILL if it
    has not exited in 60 s. Raises ``RuntimeError`` with the log's tail if it exits or does
    not come up in ``startup_s``."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(ray_command(port, replicas, flags), stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + startup_s
        while healthy_replicas(url) < replicas:
            if proc.poll() is not None:
                raise RuntimeError(f"kvreuse ray exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvreuse ray did not come up in {startup_s} s:\n{log.read_text()[-4000:]}")
            time.sleep(1.0)
        yield url, proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode
