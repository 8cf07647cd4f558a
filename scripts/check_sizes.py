"""Fail when a module under src/ is longer than the house limit (400 lines).

One noun per module and every module under src/ at most 400 lines (the developers' guide):
a module that grows past it is split along its nouns, not trimmed of blank lines. Lines are
counted as `wc -l` counts them.

Exits 0 and prints the largest module when every module fits; exits 1 and lists every
offender, longest first, otherwise.

Usage: python scripts/check_sizes.py [--max-lines N] [ROOT ...]   (ROOT defaults to src)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 400


def line_count(path: Path) -> int:
    """Number of newline characters in the file, as `wc -l` reports it."""
    return path.read_bytes().count(b"\n")


def oversized(roots: list[Path], max_lines: int) -> tuple[list[tuple[int, Path]], tuple[int, Path] | None]:
    """Return (modules over max_lines, longest first; the longest module overall or None)."""
    sizes = sorted(((line_count(p), p) for root in roots for p in root.rglob("*.py")), reverse=True)
    return [(n, p) for n, p in sizes if n > max_lines], (sizes[0] if sizes else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="*", type=Path, default=[REPO / "src"], help="folders to scan (default: src)")
    parser.add_argument("--max-lines", type=int, default=MAX_LINES, help=f"limit per module (default {MAX_LINES})")
    args = parser.parse_args(argv)
    missing = [r for r in args.roots if not r.is_dir()]
    if missing:
        print(f"check_sizes: no such folder: {', '.join(map(str, missing))}", file=sys.stderr)
        return 2
    over, longest = oversized(args.roots, args.max_lines)
    if over:
        print(f"check_sizes: {len(over)} module(s) over {args.max_lines} lines (split them along their nouns):")
        for n, path in over:
            print(f"  {n:5d}  {_shown(path)}")
        return 1
    if longest is not None:
        print(f"check_sizes: every module <= {args.max_lines} lines (longest: {_shown(longest[1])}, {longest[0]})")
    return 0


def _shown(path: Path) -> str:
    """The path relative to the repo when it is inside it."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
