"""Capacity sweep: hit rate vs pool size per policy, drawn with matplotlib (Agg, no display).

matplotlib is an optional extra (``bench``), not a runtime dependency: ``pyplot()`` raises
``PlottingUnavailable`` saying how to install it when it is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

from kvreuse.cache.eviction import make_policy
from kvreuse.simulator.belady import replay_belady
from kvreuse.simulator.replay import ReplayResult, replay
from kvreuse.simulator.traces import Trace

BELADY = "belady"  # the offline reference, accepted wherever a policy name is
PLOT_INSTALL = "pip install 'kvreuse[bench]'"  # the extra that brings matplotlib


class PlottingUnavailable(ImportError):
    """matplotlib is not installed; the message names the extra that installs it."""


def pyplot() -> ModuleType:
    """``matplotlib.pyplot`` on the Agg backend (files only; never needs a display).

    Raises ``PlottingUnavailable`` (an ``ImportError``) naming ``PLOT_INSTALL`` when
    matplotlib is missing: plotting is the ``bench`` extra, not a runtime dependency."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlottingUnavailable(
            f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL} (from a checkout: pip install '.[bench]')"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def run_policy(trace: Trace, name: str, capacity_blocks: int, **kwargs) -> ReplayResult:
    """Replay ``trace`` with the named policy (``belady`` included) on a fresh pool."""
    if name == BELADY:
        return replay_belady(trace, capacity_blocks, **kwargs)
    return replay(trace, make_policy(name, num_blocks=capacity_blocks), capacity_blocks, **kwargs)


def sweep(
    trace: Trace,
    policies: Sequence[str],
    capacities: Sequence[int],
    on_done: Callable[[ReplayResult], None] | None = None,
) -> list[ReplayResult]:
    """One replay per (policy, capacity)."""
    out = []
    for name in policies:
        for capacity in capacities:
            result = run_policy(trace, name, capacity)
            out.append(result)
            if on_done is not None:
                on_done(result)
    return out


def plot_sweep(results: Sequence[ReplayResult], path: str | Path, title: str) -> None:
    """Write a PNG with one hit-rate line per policy against capacity (blocks); raises
    ``PlottingUnavailable`` when matplotlib is not installed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r.policy for r in results):
        points = sorted((r.capacity_blocks, r.hit_rate) for r in results if r.policy == name)
        style = "--" if name == BELADY else "-"
        ax.plot([c for c, _ in points], [100 * h for _, h in points], style, marker="o", label=name)
    ax.set_xlabel("cache capacity (blocks)")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
