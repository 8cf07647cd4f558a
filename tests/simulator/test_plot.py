"""Plotting is the ``bench`` extra, not a runtime dependency: without matplotlib,
``simulator.plot.pyplot`` and both ``kvreuse simulate --plot`` paths (single pool, routed)
say how to install it, in one line, before any replay."""

import json
import sys

import pytest

from kvreuse.router.sim_cli import simulate_main as routed_main
from kvreuse.simulator.cli import simulate_main
from kvreuse.simulator.plot import PlottingUnavailable, plot_sweep, pyplot

INSTALL = "pip install 'kvreuse[bench]'"


@pytest.fixture
def no_matplotlib(monkeypatch):
    """This process as if matplotlib were not installed: a None entry in ``sys.modules``
    makes ``import matplotlib`` raise ImportError."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t.jsonl"
    records = [
        {"prompt_token_ids": list(range(16)), "output_length": 4},
        {"prompt_token_ids": list(range(100, 116)), "output_length": 4},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_pyplot_names_the_extra(no_matplotlib):
    with pytest.raises(PlottingUnavailable) as exc:
        pyplot()
    assert isinstance(exc.value, ImportError)
    assert str(exc.value) == (
        "--plot needs matplotlib, which is not installed: pip install 'kvreuse[bench]' "
        "(from a checkout: pip install '.[bench]')"
    )


def test_plot_sweep_raises_before_writing(no_matplotlib, tmp_path):
    with pytest.raises(PlottingUnavailable, match=r"kvreuse\[bench\]"):
        plot_sweep([], tmp_path / "sweep.png", "title")
    assert not (tmp_path / "sweep.png").exists()


def test_simulate_plot_says_how_to_install(no_matplotlib, trace, tmp_path, capsys):
    png = tmp_path / "sweep.png"
    assert (
        simulate_main(
            ["--trace", str(trace), "--capacity-blocks", "8", "--trace-block-tokens", "4", "--plot", str(png)]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert captured.err.startswith("kvreuse simulate: --plot needs matplotlib")
    assert INSTALL in captured.err and "Traceback" not in captured.err
    assert captured.out == "" and not png.exists()  # refused before any replay


def test_routed_simulate_plot_says_how_to_install(no_matplotlib, trace, tmp_path, capsys):
    png = tmp_path / "routed.png"
    assert (
        routed_main(
            [
                "--trace",
                str(trace),
                "--executors",
                "2",
                "--capacity-blocks",
                "8",
                "--trace-block-tokens",
                "4",
                "--plot",
                str(png),
            ]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert captured.err.startswith("kvreuse simulate: --plot needs matplotlib")
    assert INSTALL in captured.err and "Traceback" not in captured.err
    assert captured.out == "" and not png.exists()
