"""What every bench script shares: where results go, the machine a figure was measured on,
timing (medians, interleaved arms), JSON + PNG output, and servers started as subprocesses.

A script in ``bench/<group>/`` reaches this module with one line before its bench imports::

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench.common
    from bench.common import RESULTS, write_json, pyplot, save_png

and is run from the repo root as ``PYTHONPATH=src .venv/bin/python bench/<group>/<x>.py``.
Plotting needs the ``bench`` extra (``pip install '.[bench]'``); nothing here imports torch.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # what __getattr__ below hands out, for type checkers and linters
    from tests.router.cluster import Proc, executor, router, wait_healthy
    from tests.serve_process import free_port, running_server, running_servers
    from tests.tiers.redis_server import RedisServer

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]  # the repo root
RESULTS = ROOT / "bench" / "results"  # every script's default output folder
TRACE = ROOT / "data" / "traces" / "mooncake_conversation_trace.jsonl"  # the simulator's trace

if str(ROOT) not in sys.path:  # tests.serve_process etc. (the server helpers the tests use too)
    sys.path.insert(0, str(ROOT))

PLOT_HINT = "plotting needs matplotlib: pip install '.[bench]' (or pip install 'kvreuse[bench]')"


# ---------------------------------------------------------------------------- the machine
def _lscpu() -> dict[str, str]:
    """``lscpu``'s fields (``{"Model name": ..., "Flags": ...}``); from /proc/cpuinfo where
    lscpu is missing; ``{}`` where neither answers (not Linux)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=True).stdout
        return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in text.split("\n\n")[0].splitlines())}
    return {"Model name": fields.get("model name", ""), "Flags": fields.get("flags", "")}


def machine() -> dict[str, Any]:
    """Where and when a figure was measured: the CPU's model name and flags (lscpu), the
    cores this process may use, torch's thread count (when the script imported torch), the
    UTC time and the git commit. Written into every result by ``write_json``."""
    cpu = _lscpu()
    torch = sys.modules.get("torch")
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "cpu_model": cpu.get("Model name") or platform.processor() or None,
        "cpu_flags": sorted(cpu.get("Flags", "").split()),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads() if torch is not None else None,
        "utc": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "python": platform.python_version(),
    }


# ---------------------------------------------------------------------------- timing
def median(samples: Sequence[float]) -> float:
    """The median of ``samples`` (every bench figure is a median)."""
    return statistics.median(samples)


def timed(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn`` (``time.perf_counter``)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """The median over ``repeats`` calls of ``fn``, in milliseconds."""
    return median([timed(fn) for _ in range(repeats)]) * 1e3


def interleave(arms: Mapping[str, Callable[[], T]], reps: int) -> dict[str, list[T]]:
    """``reps`` rounds of every arm once, so machine noise hits all arms alike; the order
    rotates each round (two arms: A B, B A, ...), so no arm always runs after the same one.
    An arm returns its own sample (``lambda: timed(f)`` for wall seconds; any value, e.g. a
    tuple of wall and CPU time).
    Returns each arm's samples in round order."""
    names = list(arms)
    samples: dict[str, list[T]] = {n: [] for n in names}
    for r in range(reps):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(arms[name]())
    return samples


# ---------------------------------------------------------------------------- output
def write_json(path: str | Path, doc: Mapping[str, Any], *, indent: int | None = 2) -> Path:
    """``doc`` as JSON at ``path`` (folders made), with ``machine()`` added under
    ``"machine"`` unless the doc has one already; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    full = dict(doc) if "machine" in doc else {**doc, "machine": machine()}
    path.write_text(json.dumps(full, indent=indent) + "\n")
    return path


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend; exits naming the ``bench``
    extra when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(PLOT_HINT) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: str | Path, *, dpi: int = 120) -> Path:
    """``fig`` written to ``path`` (folders made) and closed; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


# ---------------------------------------------------------------------------- servers
# One place for starting servers: the same helpers the tests use (tests/serve_process.py for
# ``kvreuse serve``, tests/router/cluster.py for executors and routers), not copies of them;
# imported on first use, so a script that starts no server does not need tests/.
_SERVER_HELPERS = {
    "free_port": "tests.serve_process",
    "running_server": "tests.serve_process",
    "running_servers": "tests.serve_process",
    "Proc": "tests.router.cluster",
    "executor": "tests.router.cluster",
    "router": "tests.router.cluster",
    "wait_healthy": "tests.router.cluster",
    "RedisServer": "tests.tiers.redis_server",
}


def __getattr__(name: str) -> Any:
    """``free_port``, ``running_server(s)`` (``kvreuse serve``), ``Proc``, ``executor``,
    ``router``, ``wait_healthy`` (an executor/router cluster), ``RedisServer`` (a private
    ``redis-server``), from their test modules."""
    if name not in _SERVER_HELPERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_SERVER_HELPERS[name]), name)


@contextmanager
def environment(**values: str) -> Iterator[None]:
    """``os.environ`` with ``values`` set for the duration (servers started inside inherit
    them, e.g. ``OMP_NUM_THREADS="1"``); restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


__all__ = [
    "PLOT_HINT",
    "RESULTS",
    "ROOT",
    "TRACE",
    "Proc",
    "RedisServer",
    "environment",
    "executor",
    "free_port",
    "interleave",
    "machine",
    "median",
    "median_ms",
    "pyplot",
    "router",
    "running_server",
    "running_servers",
    "save_png",
    "timed",
    "wait_healthy",
    "write_json",
]
