"""Start ``kvreuse serve`` executors and ``kvreuse route`` routers as real processes on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """One child process; ``kill`` is SIGKILL (a crash), ``stop`` is SIGTERM then SIGKILL."""

    def __init__(self, args: list[str], log_path: str) -> None:
        self.args, self.log_path = args, log_path
        self.popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child writes to it for its whole life
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.popen = subprocess.Popen([sys.executable, "-m", "kvreuse", *self.args], stdout=log, stderr=log, env=env)
        return self

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-3000:]


def executor(
    port: int, log_dir: str, model: str = "tiny:llama", *, kv_cache_memory: float = 0.01, max_model_len: int = 1024
) -> Proc:
    return Proc(
        [
            "serve",
            "--model",
            model,
            "--port",
            str(port),
            "--device",
            "cpu",
            "--kv-cache-memory",
            str(kv_cache_memory),
            "--max-model-len",
            str(max_model_len),
            "--event-buffer-max-size",
            "10000",
            "--log-level",
            "warning",
        ],
        f"{log_dir}/executor-{port}.log",
    )


def router(port: int, executor_urls: list[str], log_dir: str, *extra: str) -> Proc:
    args = ["route", "--port", str(port), "--health-interval", "0.3", "--log-level", "warning", *extra]
    for url in executor_urls:
        args += ["--executor", url]
    return Proc(args, f"{log_dir}/router-{port}.log")


def wait_healthy(url: str, procs: list[Proc], timeout: float = 120.0, *, all_of: int | None = None) -> None:
    """Wait for ``url/health`` to answer 200 (and, for a router, ``all_of`` healthy executors)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.popen is not None and p.popen.poll() is not None:
                raise RuntimeError(f"{p.args[:2]} exited:\n{p.log()}")
        try:
            r = httpx.get(f"{url}/health", timeout=2.0)
            if r.status_code == 200 and (all_of is None or sum(e["healthy"] for e in r.json()["executors"]) == all_of):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout}s:\n" + "\n".join(p.log() for p in procs))
