"""scripts/check_sizes.py: the 400-line limit CI holds every module under src/ to."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_sizes.py"


@pytest.fixture(scope="module")
def check_sizes():
    spec = importlib.util.spec_from_file_location("check_sizes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _module(path: Path, lines: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("x = 1\n" * lines)
    return path


def test_a_module_at_the_limit_passes(check_sizes, tmp_path, capsys):
    _module(tmp_path / "pkg" / "full.py", 400)
    _module(tmp_path / "pkg" / "small.py", 3)
    assert check_sizes.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"check_sizes: every module <= 400 lines (longest: {tmp_path}/pkg/full.py, 400)\n"


def test_every_offender_is_listed_longest_first(check_sizes, tmp_path, capsys):
    _module(tmp_path / "a.py", 401)
    _module(tmp_path / "pkg" / "b.py", 900)
    _module(tmp_path / "pkg" / "c.py", 400)
    (tmp_path / "notes.txt").write_text("x\n" * 1000)  # only Python modules count
    assert check_sizes.main([str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "check_sizes: 2 module(s) over 400 lines (split them along their nouns):",
        f"    900  {tmp_path}/pkg/b.py",
        f"    401  {tmp_path}/a.py",
    ]


def test_the_limit_is_a_setting(check_sizes, tmp_path):
    _module(tmp_path / "a.py", 11)
    assert check_sizes.main(["--max-lines", "10", str(tmp_path)]) == 1
    assert check_sizes.main(["--max-lines", "11", str(tmp_path)]) == 0


def test_lines_are_counted_as_wc_does(check_sizes, tmp_path):
    path = tmp_path / "m.py"
    path.write_text("a = 1\nb = 2")  # no newline at the end: wc -l says 1
    assert check_sizes.line_count(path) == 1


def test_a_missing_folder_is_an_error_not_a_pass(check_sizes, tmp_path, capsys):
    assert check_sizes.main([str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
