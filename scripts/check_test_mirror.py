"""List the modules under src/kvreuse that have no test module of their name.

The tests mirror the package: src/kvreuse/<pkg>/<mod>.py is tested by
tests/<pkg>/test_<mod>.py (a top-level src/kvreuse/<mod>.py by tests/test_<mod>.py).
Package ``__init__.py`` and ``__main__.py`` are not counted. A test module named after no
module (tests/engine/test_store_tiers_engine.py) counts for none, whatever it exercises.

Informational: it prints the unmatched modules and a count and exits 0, unless
``--max N`` is given, when it exits 1 if more than N modules are unmatched (so CI
can hold the count from growing).

Usage: python scripts/check_test_mirror.py [--max N] [--quiet]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "kvreuse"
TESTS = ROOT / "tests"
NOT_COUNTED = {"__init__.py", "__main__.py"}


def unmatched_modules() -> tuple[list[str], int]:
    """Return (modules without tests/<pkg>/test_<mod>.py, number of modules counted)."""
    missing: list[str] = []
    counted = 0
    for module in sorted(SRC.rglob("*.py")):
        if module.name in NOT_COUNTED:
            continue
        counted += 1
        package = module.parent.relative_to(SRC)
        expected = TESTS / package / f"test_{module.stem}.py"
        if not expected.is_file():
            missing.append(str(module.relative_to(ROOT)))
    return missing, counted


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=None, help="fail above this many unmatched")
    parser.add_argument("--quiet", action="store_true", help="print only the count")
    args = parser.parse_args(argv)
    missing, counted = unmatched_modules()
    if not args.quiet:
        for path in missing:
            print(path)
    print(f"{len(missing)} of {counted} modules under src/kvreuse have no test module of their name")
    if args.max is not None and len(missing) > args.max:
        print(f"more than --max {args.max}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
